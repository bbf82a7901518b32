"""Discrete-event serving simulator that drives roofline's real scheduler on a virtual clock.

The simulator owns no policy: it builds the engine's own ``Scheduler`` and ``KVCacheManager``,
feeds them synthetic requests as their arrival times pass, and replaces the model runner with a
fake that samples a fixed token id (never EOS, so ``max_tokens`` decides every length). Each
``SchedulerOutput`` is turned into a :class:`StepShape` (decodes with their contexts, prefill
chunks with their cached prefixes) and the clock advances by the step time a
:data:`StepTimer` gives: the roofline model or a fit to measured steps. Tokens sampled in a step
are stamped with the clock at the step's end. Continuous batching, the token budget, chunked
prefill, paging, preemption and prefix hits therefore behave exactly as in the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput, SchedulerOutput
from roofline.core.scheduler import Scheduler
from roofline.planner.calibration import StepShape, StepTimer
from roofline.planner.spec_sim import SimSpeculator, SpecSimConfig
from roofline.planner.workload import SyntheticRequest, Workload
from roofline.request import Request
from roofline.sampling_params import SamplingParams

FAKE_TOKEN_ID = 11
"""The token the fake runner samples (requests carry no EOS ids, so it never stops one)."""


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    num_pages: int
    """KV pool size in pages (what the engine would allocate on one replica)."""
    page_size: int = 16
    enable_prefix_caching: bool = True
    speculative: SpecSimConfig | None = None
    """Speculative decoding at a given acceptance rate (``planner/spec_sim.py``); None: off."""
    async_scheduling: bool = False
    """The engine schedules step k+1 while step k runs (its default on CUDA): a request that
    arrives during step k is first scheduled in step k+2, one step later than in a synchronous
    engine. Only arrivals see the lag; offline requests are all in before the first step."""
    max_num_steps: int = 2_000_000
    """Safety stop against a scheduler that never finishes."""


@dataclass
class RequestMetrics:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        assert self.finish_s is not None
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for one-token requests)."""
        if self.num_output_tokens < 2 or self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class TimePoint:
    """One step: the requests and KV pages it ran with, the clock at its end."""

    time_s: float
    step_time_s: float
    num_batched_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int


@dataclass
class SimResult:
    requests: list[RequestMetrics]
    timeline: list[TimePoint]
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    spec_tokens_per_verification: float = 0.0
    """Mean tokens a verification row emitted (speculation on), else 0."""
    spec_step_share: float = 0.0
    """Share of the steps that verified proposals (the adaptive switch's choice)."""

    @property
    def duration_s(self) -> float:
        return max((r.finish_s or 0.0) for r in self.requests) if self.requests else 0.0

    @property
    def num_steps(self) -> int:
        return len(self.timeline)


def step_shape(sched_out: SchedulerOutput, page_size: int) -> StepShape:
    """The step's shape. A one-token step is a decode whose context includes the new token;
    anything longer is a prefill chunk (a fresh prompt, the rest of a chunked one, or a
    preempted request recomputing). A page that several decodes hold (a prefix shared through
    the cache: always a full page) counts as shared tokens for all holders but one."""
    num_decode = ctx_sum = 0
    chunks: list[tuple[int, int]] = []
    holders: Counter[int] = Counter()
    for s in sched_out.scheduled:
        start = s.start_position
        if s.num_new_tokens == 1:
            num_decode += 1
            ctx_sum += start + 1
            holders.update(s.block_ids)
        else:
            chunks.append((s.num_new_tokens, start))
    shared = page_size * sum(n - 1 for n in holders.values() if n > 1)
    return StepShape(num_decode, ctx_sum, tuple(chunks), min(shared, ctx_sum - num_decode))


def _make_request(i: int, req: SyntheticRequest) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
    return Request(
        request_id=f"sim-{i}",
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=params,
        eos_token_ids=frozenset(),
        max_tokens=req.max_tokens,
        arrival_time=req.arrival_time_s,
    )


def simulate(
    workload: Workload | Sequence[SyntheticRequest], sim: SimConfig, timer: StepTimer
) -> SimResult:
    """Run every request of ``workload`` to completion; returns per-request metrics and the
    state after each step."""
    reqs = workload.requests() if isinstance(workload, Workload) else list(workload)
    reqs = sorted(reqs, key=lambda r: r.arrival_time_s)
    kv = KVCacheManager(sim.num_pages, sim.page_size, sim.enable_prefix_caching)
    sched = Scheduler(sim.scheduler, kv, sim.page_size)
    metrics: dict[str, RequestMetrics] = {}
    live: dict[str, Request] = {}
    timeline: list[TimePoint] = []
    clock = 0.0
    seen_until = 0.0  # arrivals up to here are visible to the scheduler's next step
    next_i = 0
    spec = None
    if sim.speculative is not None:
        spec = SimSpeculator(
            sim.speculative,
            FAKE_TOKEN_ID,
            sim.scheduler.max_model_len,
            timer,
            sim.scheduler.max_num_seqs,
        )
    while next_i < len(reqs) or sched.has_unfinished_requests():
        if not sim.async_scheduling or not sched.has_unfinished_requests():
            seen_until = clock  # an idle engine schedules as soon as a request arrives
        while next_i < len(reqs) and reqs[next_i].arrival_time_s <= seen_until:
            request = _make_request(next_i, reqs[next_i])
            sched.add_request(request)
            live[request.request_id] = request
            metrics[request.request_id] = RequestMetrics(
                request.request_id, reqs[next_i].arrival_time_s, request.num_prompt_tokens
            )
            next_i += 1
        if not sched.has_unfinished_requests():
            clock = reqs[next_i].arrival_time_s
            continue
        if spec is not None:
            spec.before_schedule(sched.running, sched.num_running)
        out = sched.schedule()
        if out.is_empty:
            if next_i < len(reqs):
                clock = seen_until = max(clock, reqs[next_i].arrival_time_s)
                continue
            raise RuntimeError("the scheduler scheduled nothing with no arrivals left")
        if len(timeline) >= sim.max_num_steps:
            raise RuntimeError(f"simulation passed {sim.max_num_steps} steps")
        # a verification step is priced as the engine runs it (spec_sim.verification_shape)
        dt = spec.step_time_s(out, timer, sim.page_size) if spec is not None else 0.0
        dt = dt or timer(step_shape(out, sim.page_size))
        verified = {}
        if spec is not None:
            verified = spec.verify(out)
            spec.observe(out, dt)
        during = (sched.num_running, sched.num_waiting, sched.kv_usage)
        sampled = {s.request.request_id: FAKE_TOKEN_ID for s in out.scheduled if s.samples}
        seen_until = clock  # async: the next step was scheduled while this one ran
        clock += dt
        for update in sched.update(out, ModelRunnerOutput(sampled, verified=verified)):
            m = metrics[update.request.request_id]
            m.num_output_tokens += len(update.new_token_ids)
            if m.first_token_s is None:
                m.first_token_s = clock
            if update.finished:
                m.finish_s = clock
                r = live.pop(m.request_id)
                m.num_cached_tokens = r.num_cached_tokens
                m.num_preemptions = r.num_preemptions
        timeline.append(
            TimePoint(
                time_s=clock,
                step_time_s=dt,
                num_batched_tokens=out.num_batched_tokens,
                num_running=during[0],
                num_waiting=during[1],
                kv_usage=during[2],
                num_preemptions_total=sched.num_preemptions_total,
            )
        )
    return SimResult(
        requests=list(metrics.values()),
        timeline=timeline,
        num_preemptions=sched.num_preemptions_total,
        prefix_hit_tokens=kv.prefix_hits,
        prefix_query_tokens=kv.prefix_queries,
        spec_tokens_per_verification=spec.decoder.stats.mean_accepted_length if spec else 0.0,
        spec_step_share=spec.num_spec_steps / max(len(timeline), 1) if spec else 0.0,
    )
