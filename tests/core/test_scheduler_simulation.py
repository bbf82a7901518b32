"""Whole runs against a fake runner that keeps a fake KV cache.

The fake runner writes every scheduled token id into its (page, row) slot, then reads back each
request's whole context through its block table before "sampling" a token that depends on what
it read. A stale, foreign or never-written page (a prefix-cache, fork or preemption bug) fails
the read check; and since the tokens depend only on the sequence, a tiny pool that forces
preemption must end with exactly the tokens of a pool large enough for everything.
"""

from __future__ import annotations

import random

import pytest

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput, SchedulerOutput
from roofline.core.scheduler import Scheduler
from roofline.request import Request
from roofline.sampling_params import SamplingParams

PS = 4
EOS = frozenset({5, 6, 7})
MAX_MODEL_LEN = 64


def next_token(context: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) + 7 * len(context)) % 61 + 3


class FakeRunner:
    def __init__(self, num_pages: int) -> None:
        self.slots: list[list[int | None]] = [[None] * PS for _ in range(num_pages)]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for entry in out.scheduled:  # write all K/V of the step first (as every layer does)
            tokens = entry.request.all_token_ids
            for pos in range(entry.start_position, entry.start_position + entry.num_new_tokens):
                self.slots[entry.block_ids[pos // PS]][pos % PS] = tokens[pos]
        sampled = {}
        for entry in out.scheduled:  # then attend: read the whole context back
            end = entry.start_position + entry.num_new_tokens
            assert len(entry.block_ids) == -(-end // PS)
            context = [self.slots[entry.block_ids[p // PS]][p % PS] for p in range(end)]
            assert context == entry.request.all_token_ids[:end], entry.request.request_id
            if entry.samples:
                sampled[entry.request.request_id] = next_token(context)  # type: ignore[arg-type]
        return ModelRunnerOutput(sampled)


def workload(seed: int) -> list[list[Request]]:
    """Three waves of requests: a shared system prompt, a fork group, assorted lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 200) for _ in range(9)]
    waves: list[list[Request]] = [[], [], []]
    for i in range(14):
        if i % 3 == 0:
            prompt = system + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 20))]
        else:
            prompt = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.randrange(1, 16)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, 1]))
        req = Request(
            f"r{i}",
            prompt,
            params,
            eos_token_ids=EOS,
            max_tokens=max_tokens,
            arrival_time=float(i),
            priority=rng.randrange(3),
        )
        waves[i % 3].append(req)
    parent = waves[0][0]
    for j in range(2):  # two forks of the first request: same prompt, parent link
        waves[0].append(
            Request(
                f"r0-fork{j}",
                list(parent.prompt_token_ids),
                parent.sampling_params,
                eos_token_ids=EOS,
                max_tokens=parent.max_tokens,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
                parent=parent,
            )
        )
    return waves


def simulate(
    num_pages: int, config: SchedulerConfig, caching: bool, seed: int = 1
) -> tuple[dict, Scheduler]:
    kv = KVCacheManager(num_pages, PS, enable_prefix_caching=caching)
    sched = Scheduler(config, kv, PS)
    runner = FakeRunner(num_pages)
    waves = workload(seed)
    requests = [r for wave in waves for r in wave]
    for step in range(1000):
        if step < len(waves) * 2 and step % 2 == 0:
            for req in waves[step // 2]:
                sched.add_request(req)
        elif not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        ids = [e.request.request_id for e in out.scheduled]
        assert len(ids) == len(set(ids)) <= config.max_num_seqs
        assert not set(ids) & set(out.preempted_request_ids)
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        sched.update(out, runner.execute(out))
    assert not sched.has_unfinished_requests(), "the run did not finish"
    assert all(r.is_finished for r in requests)
    assert kv.num_free_pages == num_pages and kv.usage == 0.0
    return {r.request_id: (r.output_token_ids, r.status) for r in requests}, sched


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(
    ("policy", "caching", "chunked"),
    [
        ("fcfs", True, True),
        ("fcfs", False, True),
        ("priority", True, True),
        ("priority", False, True),
        ("fcfs", True, False),
    ],
)
def test_tiny_pool_gives_the_same_tokens_as_a_huge_one(policy, caching, chunked, seed) -> None:
    tiny_budget = 16 if chunked else MAX_MODEL_LEN
    huge = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=MAX_MODEL_LEN, policy=policy
    )
    tiny = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=tiny_budget,
        max_model_len=MAX_MODEL_LEN,
        policy=policy,
        enable_chunked_prefill=chunked,
    )
    expected, big = simulate(1000, huge, caching, seed)
    got, small = simulate(14, tiny, caching, seed)
    assert got == expected
    assert big.num_preemptions_total == 0 and small.num_preemptions_total > 0
    assert any(status.value == "stop" for _, status in expected.values())
    if caching:
        assert big.kv.prefix_hits > 0 and small.kv.prefix_hits > 0
