"""The validation harness's engine tracer, on a stand-in engine built from the real scheduler."""

from __future__ import annotations

from types import SimpleNamespace

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput
from roofline.core.scheduler import Scheduler
from roofline.planner.calibration import fit_calibration
from roofline.planner.metrics import reaches_steady_state, summarize
from roofline.planner.validate import trace_engine
from roofline.planner.workload import LengthDist, Workload
from roofline.request import Request


class _Runner:
    def execute(self, sched_out):
        return ModelRunnerOutput(
            {s.request.request_id: 7 for s in sched_out.scheduled if s.samples}
        )


class _Engine:
    """Just what ``trace_engine`` touches of ``LLMEngine``."""

    def __init__(self) -> None:
        self.runner = _Runner()
        self.kv = self.kv_manager = KVCacheManager(256, 16, True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), self.kv, 16)
        self.on_schedule = None

    def add_request(self, rid, tokens, params) -> None:
        self.scheduler.add_request(Request(rid, tokens, params, max_tokens=params.max_tokens))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> None:
        out = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out)
        self.scheduler.update(out, self.runner.execute(out))

    def get_stats(self):
        return SimpleNamespace(prefix_cache_hits_total=0, prefix_cache_queries_total=0)


def test_trace_records_every_step_and_token():
    work = Workload(12, LengthDist.parse("uniform:20:90"), LengthDist.parse("uniform:2:9"))
    reqs = work.requests()
    engine = _Engine()
    trace = trace_engine(engine, reqs, realtime=False)
    assert len(trace.points) == len(trace.result.timeline) > 0
    got = sorted(r.num_output_tokens for r in trace.result.requests)
    assert got == sorted(r.max_tokens for r in reqs)
    assert all(r.finish_s is not None for r in trace.result.requests)
    assert sum(p.num_prefill_tokens for p in trace.points) >= sum(
        len(r.prompt_token_ids) for r in reqs
    )
    assert engine.on_schedule is None  # the hook is removed afterwards
    assert fit_calibration(trace.points).intercept_s >= 0.0
    s = summarize(trace.result)
    assert s.num_requests == 12 and reaches_steady_state(s, 12, None)
    assert not reaches_steady_state(s, 12, 1e9)
