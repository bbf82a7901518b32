"""Steady decode steps (``core/steady.py``) against the general loop, step for step.

Two schedulers over identical requests, one taking steady steps and one never (the general
loop every step), driven through long decode runs: arrivals in bursts, async scheduling (one
step in flight) and synchronous steps, stop tokens, ``max_tokens`` and ``max_model_len`` limits,
aborts, a pool small enough to preempt, prefix caching on. Every step's plan (requests, token
counts, block ids, starts), every update, and the KV manager's pages and prefix cache must agree;
and the steady side must have taken steady steps (most of them, in the long runs).
"""

from __future__ import annotations

import random

import pytest

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput, SchedulerOutput
from roofline.core.scheduler import Scheduler
from roofline.request import Request, RequestStatus
from roofline.sampling_params import SamplingParams


class GeneralScheduler(Scheduler):
    steady_decode = False


def _plan(out: SchedulerOutput) -> tuple:
    return (
        [r.request_id for r in out.requests],
        list(out.num_new_tokens),
        [list(b) for b in out.block_ids],
        list(out.start_positions),
        list(out.samples),
        out.num_batched_tokens,
        list(out.preempted_request_ids),
        list(out.finished_request_ids),
    )


def _kv_state(kv: KVCacheManager) -> tuple:
    return (
        kv.free_queue(),
        dict(kv._cache),
        dict(kv._page_key),
        {rid: list(b) for rid, b in kv._blocks.items()},
        dict(kv._num_checked),
    )


def _updates(updates: list) -> list[tuple]:
    return [(u.request.request_id, list(u.new_token_ids), u.finished) for u in updates]


def _token(request: Request, step: int) -> int:
    n = request.num_output_tokens + request.num_pending_tokens
    return (sum(map(ord, request.request_id)) * 31 + n * 7 + step * 3) % 97 + 3


def _run(seed: int, async_steps: bool, page_size: int, num_pages: int) -> int:
    rng = random.Random(seed)
    max_model_len = 160
    config = SchedulerConfig(
        max_num_seqs=12, max_num_batched_tokens=rng.choice([64, 256]), max_model_len=max_model_len
    )
    sides = [
        cls(config, KVCacheManager(num_pages, page_size, True), page_size)
        for cls in (Scheduler, GeneralScheduler)
    ]
    requests: list[dict[str, Request]] = [{}, {}]
    in_flight: list | None = None
    num_added, num_steady = 0, 0
    shared = [rng.randrange(3, 90) for _ in range(2 * page_size + 1)]  # cached prefixes
    for step in range(3000):
        if num_added < 30 and (step % 90 == 0 or rng.random() < 0.01):  # bursts, then quiet
            for _ in range(rng.randrange(1, 8)):
                prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 40))]
                if rng.random() < 0.4:
                    prompt = shared + prompt
                stop = [rng.randrange(3, 100)] if rng.random() < 0.3 else []
                params = SamplingParams(stop_token_ids=stop)
                max_tokens = rng.randrange(1, max_model_len - len(prompt) + 1)
                rid = f"r{num_added}"
                for side, reqs in zip(sides, requests):
                    req = Request(rid, list(prompt), params, frozenset({2}), max_tokens)
                    reqs[rid] = req
                    side.add_request(req)
                num_added += 1
        if rng.random() < 0.01 and requests[0]:  # an abort
            rid = rng.choice(sorted(requests[0]))
            for side in sides:
                side.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        outs = [side.schedule() for side in sides]
        assert _plan(outs[0]) == _plan(outs[1]), f"step {step}"
        assert _kv_state(sides[0].kv) == _kv_state(sides[1].kv), f"step {step}"
        num_steady += outs[0].advances is not None
        launched = []
        for out in outs:
            ids = [r.request_id for r, s in zip(out.requests, out.samples) if s]
            tokens = [_token(r, step) for r, s in zip(out.requests, out.samples) if s]
            launched.append((out, ModelRunnerOutput(None, token_ids=tokens, request_ids=ids)))
        sync = not async_steps or rng.random() < 0.05  # a drained step now and then
        for folding in [in_flight, launched] if sync else [in_flight]:
            if folding is not None:
                results = [side.update(*s) for side, s in zip(sides, folding)]
                assert _updates(results[0]) == _updates(results[1]), f"step {step}"
        in_flight = None if sync else launched
        assert _kv_state(sides[0].kv) == _kv_state(sides[1].kv), f"step {step}"
        if num_added >= 30 and not sides[0].has_unfinished_requests() and in_flight is None:
            break
    for rid, req in requests[0].items():
        other = requests[1][rid]
        assert (req.output_token_ids, req.status) == (other.output_token_ids, other.status)
    assert not sides[1].has_unfinished_requests()
    return num_steady


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("async_steps", [True, False])
def test_steady_steps_plan_as_the_general_loop(seed: int, async_steps: bool) -> None:
    num_steady = _run(seed, async_steps, page_size=rng_page(seed), num_pages=400)
    assert num_steady > 100  # the runs are mostly steady decode


@pytest.mark.parametrize("seed", range(3))
def test_steady_steps_under_page_pressure(seed: int) -> None:
    """A pool too small for everyone: steady runs end in preemptions, exactly as the general
    loop's."""
    _run(100 + seed, True, page_size=4, num_pages=60)


def rng_page(seed: int) -> int:
    return (16, 4, 8, 2)[seed % 4]
