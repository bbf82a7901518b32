"""The scheduler's lean per-request loops against a reference written the plain way.

``Scheduler._schedule_running`` and ``Scheduler.update`` run once per request per step, so they
inline ``Request.num_tokens``, the pending-token length check and the stop rules' common case.
``ReferenceScheduler`` overrides both with the straightforward code (every property read, every
token through ``_check_stop``). Random runs drive the two side by side with identical inputs
(the fast side's async steps get the sampled ids as lists in the step's order, the reference's as
a dict):
arrivals, chunked prefill, preemption in a small pool, aborts, async scheduling (one step in
flight, pending tokens), speculative proposals (synchronous steps, verified tokens), stop
tokens, EOS, ``max_tokens`` and ``max_model_len``; every step's plan and updates must agree.
"""

from __future__ import annotations

import random

import pytest

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import (
    ModelRunnerOutput,
    RequestUpdate,
    SchedulerOutput,
    TokenLogprobs,
    VerifiedTokens,
)
from roofline.core.scheduler import Scheduler, _fit_proposals, _Step
from roofline.request import Request, RequestStatus
from roofline.sampling_params import SamplingParams

PS = 4
MAX_MODEL_LEN = 48


class ReferenceScheduler(Scheduler):
    steady_decode = False  # the general loop every step (core/steady.py is tested apart)

    def _schedule_running(self, step: _Step) -> None:
        for request in list(self.running):
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            if self._finishes_on_pending(request):
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if request.spec_token_ids:
                num_new = _fit_proposals(request, num_new)
            while True:
                block_ids = self.kv.allocate(request, num_new)
                if block_ids is not None:
                    step.add(request, num_new, block_ids)
                    break
                if request.spec_token_ids:
                    request.spec_token_ids = []
                    num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
                    continue
                victim = self._running_victim()
                self._preempt(victim, step)
                if victim is request:
                    break

    def update(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for entry in sched_out.scheduled:
            request = entry.request
            if not entry.samples or request.is_finished:
                continue
            request.num_pending_tokens -= 1
            rid = request.request_id
            if runner_out.verified and rid in runner_out.verified:
                updates.append(self._update_verified(request, runner_out.verified[rid]))
                continue
            token = runner_out.sampled_token_ids[rid]
            request.output_token_ids.append(token)
            logprobs = [runner_out.logprobs[rid]] if rid in runner_out.logprobs else []
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request, [token], logprobs, status is not None))
        return updates


def _plan(out: SchedulerOutput) -> tuple:
    return (
        [
            (e.request.request_id, e.num_new_tokens, list(e.block_ids), e.start_position, e.samples)
            for e in out.scheduled
        ],
        out.num_batched_tokens,
        list(out.preempted_request_ids),
        list(out.finished_request_ids),
    )


def _updates(updates: list[RequestUpdate]) -> list[tuple]:
    return [
        (u.request.request_id, list(u.new_token_ids), list(u.new_logprobs), u.finished)
        for u in updates
    ]


def _token(request: Request, salt: int) -> int:
    """Deterministic in the request's state, so both sides sample the same ids."""
    n = request.num_output_tokens + request.num_pending_tokens
    return (sum(map(ord, request.request_id)) * 31 + n * 7 + salt * 13) % 40 + 1


class Side:
    def __init__(self, cls: type[Scheduler], config: SchedulerConfig, num_pages: int) -> None:
        self.sched = cls(config, KVCacheManager(num_pages, PS, True), PS)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> None:
        req = Request(rid, list(prompt), params, frozenset({1}), max_tokens, arrival_time=0.0)
        self.requests[rid] = req
        self.sched.add_request(req)

    def run_out(self, out: SchedulerOutput, rng: random.Random, logprob_ids: set) -> tuple:
        sampled, logprobs, verified = {}, {}, {}
        for e in out.scheduled:
            if not e.samples:
                continue
            req, rid = e.request, e.request.request_id
            sampled[rid] = _token(req, 0)
            if rid in logprob_ids:
                logprobs[rid] = TokenLogprobs(sampled[rid], -0.5, 1, [])
            if req.spec_token_ids:
                k = len(req.spec_token_ids)
                accepted = rng.randrange(k + 1)
                ids = req.spec_token_ids[:accepted] + [_token(req, 1)]
                verified[rid] = VerifiedTokens(ids, k)
                sampled[rid] = ids[-1]
        return sampled, logprobs, verified


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["async", "sync_spec"])
def test_fast_loops_match_the_reference(seed: int, mode: str) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=MAX_MODEL_LEN,
        policy=rng.choice(["fcfs", "priority"]),
    )
    num_pages = rng.choice([14, 20, 64])
    fast = Side(Scheduler, config, num_pages)
    ref = Side(ReferenceScheduler, config, num_pages)
    sides = (fast, ref)
    logprob_ids: set[str] = set()
    in_flight: tuple | None = None
    num_added = 0
    for _step in range(400):
        if num_added < 24 and rng.random() < 0.3:  # arrivals
            prompt = [rng.randrange(2, 50) for _ in range(rng.randrange(1, 20))]
            stop_ids = [rng.randrange(2, 42)] if rng.random() < 0.3 else []
            params = SamplingParams(stop_token_ids=stop_ids, min_tokens=rng.choice([0, 0, 2]))
            max_tokens = rng.randrange(1, MAX_MODEL_LEN - len(prompt) + 1)
            rid = f"r{num_added}"
            if rng.random() < 0.3:
                logprob_ids.add(rid)
            for side in sides:
                side.add(rid, prompt, params, max_tokens)
            num_added += 1
        if rng.random() < 0.05 and fast.requests:  # an abort
            rid = rng.choice(sorted(fast.requests))
            for side in sides:
                side.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        if mode == "sync_spec":  # proposals for requests with no pending token
            for rid, req in sorted(fast.requests.items()):
                if req.status is RequestStatus.RUNNING and not req.num_pending_tokens:
                    if rng.random() < 0.5:
                        proposal = [rng.randrange(2, 42) for _ in range(rng.randrange(1, 4))]
                        for side in sides:
                            side.requests[rid].spec_token_ids = list(proposal)
        outs = [side.sched.schedule() for side in sides]
        assert _plan(outs[0]) == _plan(outs[1])
        runs = [side.run_out(o, random.Random(_step), logprob_ids) for side, o in zip(sides, outs)]
        launched = [(out, ModelRunnerOutput(s, lp, v)) for out, (s, lp, v) in zip(outs, runs)]
        if mode == "async":  # the fast side gets the ids as lists in the step's order
            out, (s, lp, _v) = outs[0], runs[0]
            ids = [r.request_id for r, samples in zip(out.requests, out.samples) if samples]
            lists = ModelRunnerOutput(None, lp, token_ids=[s[r] for r in ids], request_ids=ids)
            assert lists.sampled_token_ids == s
            launched[0] = (out, lists)
        if mode == "async":  # fold the previous step in after launching this one
            if in_flight is not None:
                results = [side.sched.update(*step) for side, step in zip(sides, in_flight)]
                assert _updates(results[0]) == _updates(results[1])
            in_flight = tuple(launched)
        else:
            results = [side.sched.update(*step) for side, step in zip(sides, launched)]
            assert _updates(results[0]) == _updates(results[1])
        if num_added >= 24 and not fast.sched.has_unfinished_requests():
            break
    for rid, req in fast.requests.items():
        other = ref.requests[rid]
        assert (req.output_token_ids, req.status) == (other.output_token_ids, other.status)
    assert num_added == 24 and not fast.sched.has_unfinished_requests()
