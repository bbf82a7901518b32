"""Scheduler: token budget, chunking, admission limits, preemption, priority, forks."""

from __future__ import annotations

from typing import Any

import pytest

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import (
    ModelRunnerOutput,
    RequestUpdate,
    SchedulerOutput,
    TokenLogprobs,
)
from roofline.core.scheduler import QueueFullError, Scheduler
from roofline.request import RequestStatus

PS = 4  # page_size in every test here
TOKEN = 1  # what the fake runner samples unless told otherwise


def make_scheduler(num_pages: int = 64, caching: bool = False, **config: Any) -> Scheduler:
    config.setdefault("max_model_len", 128)
    kv = KVCacheManager(num_pages, PS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv, PS)


def run_step(
    sched: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """schedule() -> fake runner (samples where a request reaches its end) -> update()."""
    out = sched.schedule()
    tokens = tokens or {}
    sampled = {
        e.request.request_id: tokens.get(e.request.request_id, TOKEN)
        for e in out.scheduled
        if e.samples
    }
    return out, sched.update(out, ModelRunnerOutput(sampled))


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(e.request.request_id, e.num_new_tokens) for e in out.scheduled]


def test_long_prompt_is_chunked_over_steps(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request("a", range(10), max_tokens=3)
    sched.add_request(req)
    out, updates = run_step(sched)
    assert plan(out) == [("a", 4)] and out.scheduled[0].block_ids == [0]
    assert updates == [] and req.num_computed_tokens == 4
    out, updates = run_step(sched)
    assert plan(out) == [("a", 4)] and out.scheduled[0].block_ids == [0, 1]
    assert updates == []
    out, updates = run_step(sched)
    assert plan(out) == [("a", 2)] and out.scheduled[0].block_ids == [0, 1, 2]
    assert [u.new_token_ids for u in updates] == [[TOKEN]]
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    assert req.first_scheduled_time is not None and req.first_token_time is not None


def test_decodes_and_a_prefill_chunk_share_one_step(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", range(3))
    b = make_request("b", range(5))
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert plan(out) == [("a", 3), ("b", 5)] and out.num_batched_tokens == 8
    c = make_request("c", range(20))
    sched.add_request(c)
    out, _ = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 6)] and out.num_batched_tokens == 8
    out, _ = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 6)]
    assert c.num_computed_tokens == 12


def test_max_num_seqs_caps_running_requests(make_request) -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, range(4), max_tokens=2))
    out, _ = run_step(sched)
    assert plan(out) == [("a", 4), ("b", 4)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, updates = run_step(sched)  # a and b reach max_tokens
    assert plan(out) == [("a", 1), ("b", 1)] and all(u.finished for u in updates)
    out, _ = run_step(sched)
    assert plan(out) == [("c", 4)] and out.finished_request_ids == ["a", "b"]


def test_fcfs_preempts_the_most_recent_request(make_request) -> None:
    sched = make_scheduler(num_pages=4, max_num_seqs=2)
    a = make_request("a", range(7), max_tokens=8)
    b = make_request("b", range(10, 17), max_tokens=8)
    d = make_request("d", range(20, 22), max_tokens=8)
    for req in (a, b, d):
        sched.add_request(req)
    out, _ = run_step(sched)
    assert [e.block_ids for e in out.scheduled] == [[0, 1], [2, 3]]
    run_step(sched)  # 8 tokens each: still 2 pages each
    out, _ = run_step(sched)  # a needs a 3rd page: b goes
    assert plan(out) == [("a", 1)] and out.scheduled[0].block_ids == [0, 1, 3]
    assert out.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert [r.request_id for r in sched.waiting] == ["b", "d"]
    assert b.num_tokens == 9  # keeps its 2 sampled tokens and recomputes them
    while a.status is RequestStatus.RUNNING:
        run_step(sched)
    out = sched.schedule()
    assert plan(out) == [("b", 9), ("d", 2)]
    assert out.scheduled[0].start_position == 0
    assert out.scheduled[0].token_ids == b.all_token_ids


def test_a_request_that_is_its_own_victim_stops_for_the_step(make_request) -> None:
    sched = make_scheduler(num_pages=4)
    a = make_request("a", range(6), max_tokens=8)
    b = make_request("b", range(10, 18), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: [0, 1]; b: [2, 3], 9 tokens after sampling
    out, _ = run_step(sched)
    assert plan(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert sched.waiting == [b] and sched.running == [a]


def test_priority_admission_order(make_request) -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("low", range(4), priority=5))
    sched.add_request(make_request("high", range(4), priority=0))
    sched.add_request(make_request("high2", range(4), priority=0))
    out, _ = run_step(sched)
    assert plan(out) == [("high", 4)]
    sched.finish_requests("high", RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    assert plan(out) == [("high2", 4)]


def test_priority_admission_preempts_lower_priority(make_request) -> None:
    sched = make_scheduler(num_pages=4, policy="priority")
    low = make_request("low", range(12), max_tokens=4, priority=5)
    same = make_request("same", range(50, 58), max_tokens=4, priority=1)
    sched.add_request(low)
    run_step(sched)  # low holds pages 0..2 (13 tokens after sampling)
    high = make_request("high", range(100, 108), max_tokens=4, priority=1)
    sched.add_request(high)
    out, _ = run_step(sched)
    # low was scheduled first this step; it is unscheduled and its budget given back
    assert plan(out) == [("high", 8)] and out.num_batched_tokens == 8
    assert out.preempted_request_ids == ["low"]
    assert out.scheduled[0].block_ids == [3, 2]
    assert low.status is RequestStatus.PREEMPTED and sched.waiting == [low]
    sched.add_request(same)  # equal priority: waits instead of preempting high
    out, _ = run_step(sched)
    assert plan(out) == [("high", 1)] and out.preempted_request_ids == []
    assert same.status is RequestStatus.WAITING


def test_priority_running_victim_may_be_already_scheduled(make_request) -> None:
    sched = make_scheduler(num_pages=4, policy="priority")
    low = make_request("low", range(5), max_tokens=4, priority=5)
    high = make_request("high", range(10, 18), max_tokens=4, priority=0)
    sched.add_request(low)
    run_step(sched)  # low: pages [0, 1]
    sched.add_request(high)
    out, _ = run_step(sched)  # low decodes, high: pages [2, 3]
    assert plan(out) == [("low", 1), ("high", 8)]
    out, _ = run_step(sched)  # high needs a 3rd page; low (scheduled first) is the victim
    assert plan(out) == [("high", 1)] and out.num_batched_tokens == 1
    assert out.scheduled[0].block_ids == [2, 3, 1]
    assert out.preempted_request_ids == ["low"] and sched.waiting == [low]


@pytest.mark.parametrize(
    ("tokens", "kwargs", "status", "stop_reason", "num_outputs"),
    [
        ([7], {}, RequestStatus.FINISHED_STOPPED, None, 1),
        ([7, 7], {"min_tokens": 2}, RequestStatus.FINISHED_STOPPED, None, 2),
        ([3, 9], {"stop_token_ids": [9]}, RequestStatus.FINISHED_STOPPED, 9, 2),
        ([9, 9], {"stop_token_ids": [9], "min_tokens": 2}, RequestStatus.FINISHED_STOPPED, 9, 2),
        ([3, 3, 3], {}, RequestStatus.FINISHED_LENGTH, None, 3),
        ([3, 3, 7], {"min_tokens": 3}, RequestStatus.FINISHED_STOPPED, None, 3),
        ([7, 7, 7], {"ignore_eos": True}, RequestStatus.FINISHED_LENGTH, None, 3),
    ],
)
def test_stop_conditions(make_request, tokens, kwargs, status, stop_reason, num_outputs) -> None:
    sched = make_scheduler()
    eos = frozenset() if kwargs.get("ignore_eos") else frozenset({7})
    req = make_request("r", range(4), max_tokens=3, eos_token_ids=eos, **kwargs)
    sched.add_request(req)
    free_before = sched.kv.num_free_pages
    for token in tokens:
        _, updates = run_step(sched, {"r": token})
    assert (req.status, req.stop_reason, req.num_output_tokens) == (
        status,
        stop_reason,
        num_outputs,
    )
    assert updates[-1].finished and req.output_token_ids == tokens
    assert sched.kv.num_free_pages == free_before and not sched.has_unfinished_requests()
    assert sched.get_request("r") is None
    assert sched.schedule().finished_request_ids == ["r"]


def test_max_model_len_stops_a_request(make_request) -> None:
    sched = make_scheduler(max_model_len=6)
    req = make_request("r", range(4), max_tokens=2)
    sched.add_request(req)
    req.max_tokens = 5  # defensive path: the context limit still ends it
    run_step(sched)
    run_step(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 6


def test_abort_is_idempotent_and_frees_pages(make_request) -> None:
    sched = make_scheduler(num_pages=8, max_num_seqs=1)
    run, wait = make_request("run", range(9)), make_request("wait", range(3))
    sched.add_request(run)
    sched.add_request(wait)
    run_step(sched)
    assert sched.kv.num_free_pages == 5
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    assert run.status is wait.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_pages == 8 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["run", "wait"]
    assert sched.schedule().finished_request_ids == []


def test_abort_mid_step_is_not_resurrected(make_request) -> None:
    sched = make_scheduler()
    req = make_request("r", range(4))
    sched.add_request(req)
    out = sched.schedule()
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, ModelRunnerOutput({"r": 5})) == []
    assert req.output_token_ids == [] and sched.kv.num_free_pages == 64
    assert req.status is RequestStatus.FINISHED_ABORTED and sched.running == []


def test_requests_that_can_never_run_are_refused(make_request) -> None:
    sched = make_scheduler(num_pages=4, max_model_len=32, max_num_waiting=1)
    with pytest.raises(ValueError, match=r"\(30 tokens\).*\(8\).*38.*max_model_len \(32\)"):
        sched.add_request(make_request("long", range(30), max_tokens=8))
    with pytest.raises(ValueError, match="needs 5 KV pages but the whole pool has 4"):
        sched.add_request(make_request("big", range(14), max_tokens=3))
    sched.add_request(make_request("ok", range(12), max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", range(2), max_tokens=2))
    with pytest.raises(QueueFullError, match="full"):
        sched.add_request(make_request("late", range(2), max_tokens=2))
    assert sched.num_waiting == 1


def test_forks_share_the_parent_prompt_pages(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=12)
    prompt = list(range(10))  # share_len = 8: two full pages, tokens 8..9 computed per fork
    parent = make_request("p", prompt)
    c1 = make_request("c1", prompt, parent=parent)
    c2 = make_request("c2", prompt, parent=parent)
    other = make_request("u", [40, 41])
    for req in (parent, c1, c2, other):
        sched.add_request(req)
    out, _ = run_step(sched)
    assert plan(out) == [("p", 10), ("u", 2)]  # forks wait, without blocking u
    out, _ = run_step(sched)
    assert plan(out) == [("p", 1), ("u", 1), ("c1", 2), ("c2", 2)]
    assert [e.block_ids for e in out.scheduled] == [[0, 1, 2], [3], [0, 1, 4], [0, 1, 5]]
    assert [sched.kv.ref_count(p) for p in (0, 1, 2)] == [3, 3, 1]
    assert c1.num_cached_tokens == 8 and c1.output_token_ids == [TOKEN]
    sched.finish_requests(["p", "c1"], RequestStatus.FINISHED_ABORTED)
    assert [sched.kv.ref_count(p) for p in (0, 1, 2, 4)] == [1, 1, 0, 0]


def test_fork_of_a_finished_parent_takes_the_normal_path(make_request) -> None:
    sched = make_scheduler(caching=True)
    prompt = list(range(10))
    parent = make_request("p", prompt, max_tokens=1)
    sched.add_request(parent)
    run_step(sched)
    assert parent.status is RequestStatus.FINISHED_LENGTH
    child = make_request("c", prompt, parent=parent)
    sched.add_request(child)
    out, _ = run_step(sched)
    assert plan(out) == [("c", 2)] and out.scheduled[0].block_ids == [0, 1, 3]
    assert child.num_cached_tokens == 8 and sched.kv.prefix_hits == 8


def test_pages_a_preempted_victim_never_wrote_leave_the_cache(make_request) -> None:
    sched = make_scheduler(num_pages=6, caching=True, policy="priority", max_num_batched_tokens=12)
    low = make_request("low", range(100, 120), max_tokens=2, priority=5)
    sched.add_request(make_request("y", [1, 2], max_tokens=8))
    sched.add_request(low)
    out, _ = run_step(sched)
    assert [e.block_ids for e in out.scheduled] == [[0], [1, 2, 3]]
    sched.add_request(make_request("high", [7, 8, 9], max_tokens=2))
    out, _ = run_step(sched)  # low registers pages 3, 4, 5 for tokens 10..19, then is preempted
    assert plan(out) == [("y", 1), ("high", 3)] and out.preempted_request_ids == ["low"]
    assert out.scheduled[1].block_ids == [5]
    assert sched.kv.free_queue() == [4, 3, 2, 1]
    assert [sched.kv.is_cached(p) for p in range(1, 5)] == [True, True, False, False]
    probe = make_request("probe", list(range(100, 120)) + [0])
    assert sched.kv.lookup_prefix(probe).block_ids == [1, 2]  # only what low really computed


def test_no_preemption_of_a_writer_whose_fresh_pages_a_reader_shares(make_request) -> None:
    sched = make_scheduler(num_pages=5, caching=True, policy="priority", max_num_batched_tokens=8)
    low = make_request("low", range(100, 114), max_tokens=2, priority=5)
    sched.add_request(low)
    run_step(sched)  # low: tokens 0..7 in pages [0, 1]
    reader = make_request("reader", list(range(100, 112)) + [0], max_tokens=2, priority=0)
    late = make_request("late", [3], max_tokens=2, priority=1)
    sched.add_request(reader)
    sched.add_request(late)
    out = sched.schedule()
    # low writes page 2 (tokens 8..11) in this step and reader already attends it
    assert plan(out) == [("low", 6), ("reader", 1)]
    assert [e.block_ids for e in out.scheduled] == [[0, 1, 2, 3], [0, 1, 2, 4]]
    assert reader.num_cached_tokens == 12
    # late outranks low, but preempting low now would leave page 2 unwritten for reader
    assert out.preempted_request_ids == [] and late.status is RequestStatus.WAITING


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(make_request) -> None:
    sched = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", range(10), max_tokens=4))
    sched.add_request(make_request("b", range(8), max_tokens=4))
    sched.add_request(make_request("c", range(3), max_tokens=4))
    out, _ = run_step(sched)
    assert plan(out) == [("a", 10)]  # b does not fit the 6 tokens left; c stays behind it
    out, _ = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 8), ("c", 3)]


def test_update_passes_logprobs_and_timestamps(make_request) -> None:
    sched = make_scheduler()
    req = make_request("r", range(4))
    sched.add_request(req)
    out = sched.schedule()
    logprobs = TokenLogprobs(token_id=9, logprob=-0.5, rank=1, top=[(9, -0.5)])
    (update,) = sched.update(out, ModelRunnerOutput({"r": 9}, {"r": logprobs}))
    assert update.request is req and update.new_token_ids == [9]
    assert update.new_logprobs == [logprobs] and not update.finished
    assert req.first_token_time == req.last_token_time is not None
    assert sched.get_request("r") is req and sched.kv_usage == pytest.approx(1 / 64)
    assert (sched.num_running, sched.num_waiting) == (1, 0)


# ----------------------------------------------------------------- async scheduling


def _sampled(out: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    return ModelRunnerOutput({e.request.request_id: tokens[e.request.request_id]
                              for e in out.scheduled if e.samples})  # fmt: skip


def test_next_step_is_scheduled_before_the_previous_one_lands(make_request) -> None:
    """Step N+1 is decided while step N runs: it decodes N's pending token; the updates then
    land in order, each filling the oldest pending token."""
    sched = make_scheduler()
    req = make_request("a", range(6), max_tokens=8)
    sched.add_request(req)
    first = sched.schedule()
    assert plan(first) == [("a", 6)] and req.num_pending_tokens == 1 and req.num_tokens == 7
    second = sched.schedule()  # before first's update
    entry = second.scheduled[0]
    assert plan(second) == [("a", 1)] and entry.start_position == 6 and entry.samples
    assert entry.token_ids == []  # position 6 is first's pending token: the runner's business
    assert req.num_pending_tokens == 2 and req.num_computed_tokens == 7
    assert [u.new_token_ids for u in sched.update(first, _sampled(first, {"a": 40}))] == [[40]]
    assert req.output_token_ids == [40] and req.num_pending_tokens == 1
    third = sched.schedule()
    assert third.scheduled[0].token_ids == [] and third.scheduled[0].start_position == 7
    sched.update(second, _sampled(second, {"a": 41}))
    assert third.scheduled[0].token_ids == [41]
    sched.update(third, _sampled(third, {"a": 42}))
    assert req.output_token_ids == [40, 41, 42] and req.num_pending_tokens == 0


def test_pending_tokens_that_reach_max_tokens_are_not_extended(make_request) -> None:
    sched = make_scheduler()
    req = make_request("a", range(3), max_tokens=2)
    sched.add_request(req)
    first, second = sched.schedule(), sched.schedule()
    assert plan(second) == [("a", 1)]
    assert sched.schedule().is_empty  # two pending tokens = max_tokens: nothing to compute
    sched.update(first, _sampled(first, {"a": 5}))
    updates = sched.update(second, _sampled(second, {"a": 6}))
    assert updates[0].finished and req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [5, 6] and sched.kv.num_free_pages == 64


def test_eos_while_the_next_step_is_in_flight(make_request) -> None:
    """EOS lands after step N+1 was launched: the request finishes, its pages are freed, and
    N+1's token for it is dropped."""
    sched = make_scheduler()
    req = make_request("a", range(3), max_tokens=8, eos_token_ids=frozenset({2}))
    sched.add_request(req)
    first, second = sched.schedule(), sched.schedule()
    assert sched.update(first, _sampled(first, {"a": 2}))[0].finished
    assert sched.kv.num_free_pages == 64 and not sched.has_unfinished_requests()
    assert sched.update(second, _sampled(second, {"a": 9})) == []
    assert req.output_token_ids == [2] and req.status is RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_request_ids == ["a"]


def test_preempted_while_sampling_keeps_its_token(make_request) -> None:
    """A request preempted while a launched step samples for it gets that token when it lands,
    waits for it, and then recomputes prompt + outputs."""
    sched = make_scheduler(num_pages=3, max_model_len=12)
    a = make_request("a", range(4), max_tokens=8)
    b = make_request("b", range(4), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # 2 prompt pages of 3
    assert plan(first) == [("a", 4), ("b", 4)]
    second = sched.schedule()  # both need a 3rd page: the latest admitted (b) is preempted
    assert plan(second) == [("a", 1)] and second.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    sched.update(first, _sampled(first, {"a": 7, "b": 8}))
    assert b.output_token_ids == [8] and b.num_pending_tokens == 0 and b.num_tokens == 5
    sched.update(second, _sampled(second, {"a": 9}))
    a.max_tokens = 2  # a finishes at its next token, freeing the pages b needs
    third = sched.schedule()
    assert plan(third) == [("a", 1)]
    sched.update(third, _sampled(third, {"a": 3}))
    assert a.is_finished
    fourth = sched.schedule()
    assert plan(fourth) == [("b", 5)] and fourth.scheduled[0].token_ids == [0, 1, 2, 3, 8]
