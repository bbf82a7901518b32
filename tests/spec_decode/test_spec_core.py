"""Scheduler and KV-manager side of speculative decoding, on the CPU with exact asserts:
proposals count as tokens, a short budget drops the ones that do not fit, rejected slots roll
back and pages that held only rejected tokens return to the free queue."""

from __future__ import annotations

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput, VerifiedTokens
from roofline.core.scheduler import Scheduler
from roofline.request import Request
from roofline.sampling_params import SamplingParams


def _running(budget: int = 64) -> tuple[Scheduler, KVCacheManager, Request]:
    kv = KVCacheManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=32), kv, 4)
    r = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0.0), max_tokens=20)
    sched.add_request(r)
    while not r.output_token_ids:  # the prompt, in chunks under a small budget
        out = sched.schedule()
        sched.update(out, ModelRunnerOutput({"a": 7}))
    return sched, kv, r


def test_verification_row_and_rollback():
    sched, kv, r = _running()
    assert kv.get_block_ids("a") == [0, 1]  # 6 prompt tokens
    r.spec_token_ids = [8, 9, 10]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.start_position, s.samples) == (4, 6, True)
    assert s.token_ids == [7, 8, 9, 10]
    assert kv.get_block_ids("a") == [0, 1, 2]  # positions 6..9 reach a third page
    # the target accepts 8, rejects 9 and says 11: emitted [8, 11]
    upd = sched.update(
        out, ModelRunnerOutput({"a": 11}, verified={"a": VerifiedTokens([8, 11], 3)})
    )
    assert upd[0].new_token_ids == [8, 11]
    assert r.output_token_ids == [7, 8, 11] and r.spec_token_ids == []
    assert r.num_computed_tokens == 8  # 6 prompt + 7 + 8; 11 is the next input
    assert kv.get_block_ids("a") == [0, 1]  # page 2 held only rejected slots
    assert kv.free_queue()[-1] == 2 and kv.ref_count(2) == 0 and not kv.is_cached(2)


def test_short_budget_drops_the_proposals_that_do_not_fit():
    sched, _, r = _running(budget=3)
    r.spec_token_ids = [8, 9, 10]
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 3 and s.samples and r.spec_token_ids == [8, 9]


def test_stop_token_inside_the_accepted_run():
    sched, kv, r = _running()
    r.sampling_params = SamplingParams(temperature=0.0, stop_token_ids=[9])
    r.spec_token_ids = [8, 9, 10]
    out = sched.schedule()
    upd = sched.update(
        out, ModelRunnerOutput({"a": 12}, verified={"a": VerifiedTokens([8, 9, 10, 12], 3)})
    )
    assert upd[0].new_token_ids == [8, 9] and upd[0].finished
    assert r.output_token_ids == [7, 8, 9] and kv.usage == 0.0
