"""Summaries of simulated runs: latency percentiles, throughput, goodput under SLOs, and the
sweeps that answer "what load can one replica take" and "how many replicas for this load".

Goodput counts only requests that meet every SLO given (TTFT, TPOT, end to end) per second of
the run. Replica sweeps split a Poisson stream of rate ``R`` evenly at random over ``N``
replicas, so each sees a Poisson stream of rate ``R / N``; one replica is simulated per ``N``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from roofline.planner.calibration import StepTimer
from roofline.planner.simulator import SimConfig, SimResult, simulate
from roofline.planner.workload import Workload

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met_by(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
        return (
            (self.ttft_s is None or ttft_s <= self.ttft_s)
            and (self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s)
            and (self.e2e_s is None or e2e_s <= self.e2e_s)
        )


@dataclass(frozen=True)
class SimSummary:
    num_requests: int
    duration_s: float
    num_steps: int
    request_throughput: float
    """Finished requests per second."""
    output_tokens_per_s: float
    total_tokens_per_s: float
    """Prompt and output tokens per second."""
    ttft_s: dict[int, float]
    tpot_s: dict[int, float]
    e2e_s: dict[int, float]
    slo_attainment: float
    """Fraction of requests meeting the SLO (1.0 when no SLO is set)."""
    goodput_rps: float
    num_preemptions: int
    peak_kv_usage: float
    mean_kv_usage: float
    """Time-weighted over the steps."""
    mean_running: float
    prefix_hit_rate: float


def _pct(values: list[float]) -> dict[int, float]:
    if not values:
        return {p: float("nan") for p in PERCENTILES}
    arr = np.asarray(values)
    return {p: float(np.percentile(arr, p)) for p in PERCENTILES}


def summarize(result: SimResult, slo: SLO | None = None) -> SimSummary:
    reqs = [r for r in result.requests if r.finish_s is not None]
    duration = result.duration_s or 1e-12
    ttfts = [r.ttft_s for r in reqs]
    tpots = [t for t in (r.tpot_s for r in reqs) if t is not None]
    e2es = [r.e2e_s for r in reqs]
    slo = slo or SLO()
    good = sum(1 for r in reqs if slo.met_by(r.ttft_s, r.tpot_s, r.e2e_s))
    out_tokens = sum(r.num_output_tokens for r in reqs)
    prompt_tokens = sum(r.num_prompt_tokens for r in reqs)
    steps = result.timeline
    busy = sum(p.step_time_s for p in steps) or 1e-12
    return SimSummary(
        num_requests=len(reqs),
        duration_s=result.duration_s,
        num_steps=result.num_steps,
        request_throughput=len(reqs) / duration,
        output_tokens_per_s=out_tokens / duration,
        total_tokens_per_s=(out_tokens + prompt_tokens) / duration,
        ttft_s=_pct(ttfts),
        tpot_s=_pct(tpots),
        e2e_s=_pct(e2es),
        slo_attainment=good / len(reqs) if reqs else 0.0,
        goodput_rps=good / duration,
        num_preemptions=result.num_preemptions,
        peak_kv_usage=max((p.kv_usage for p in steps), default=0.0),
        mean_kv_usage=sum(p.kv_usage * p.step_time_s for p in steps) / busy,
        mean_running=sum(p.num_running * p.step_time_s for p in steps) / busy,
        prefix_hit_rate=(
            result.prefix_hit_tokens / result.prefix_query_tokens
            if result.prefix_query_tokens
            else 0.0
        ),
    )


def reaches_steady_state(summary: SimSummary, num_requests: int, rate: float | None) -> bool:
    """False when arrivals stop before five median request lifetimes have passed: the run
    then mostly measures filling and draining, not the load (raise the request count)."""
    if rate is None or summary.num_requests == 0:
        return True
    return num_requests / rate >= 5.0 * summary.e2e_s[50]


@dataclass(frozen=True)
class SweepRow:
    x: float
    """The swept value: a request rate, or a replica count."""
    summary: SimSummary


def sweep_rates(
    workload: Workload,
    rates: list[float],
    sim: SimConfig,
    timer: StepTimer,
    slo: SLO | None = None,
) -> list[SweepRow]:
    """One simulation per request rate, same seed and lengths otherwise."""
    rows = []
    for rate in rates:
        w = dataclasses.replace(workload, request_rate=rate)
        rows.append(SweepRow(rate, summarize(simulate(w, sim, timer), slo)))
    return rows


@dataclass(frozen=True)
class ReplicaPlan:
    num_replicas: int | None
    """Fewest replicas meeting the target (None when ``max_replicas`` do not)."""
    rows: list[SweepRow]


def replicas_needed(
    workload: Workload,
    total_rate: float,
    sim: SimConfig,
    timer: StepTimer,
    slo: SLO,
    target_attainment: float = 0.99,
    max_replicas: int = 64,
) -> ReplicaPlan:
    """Fewest replicas so that ``target_attainment`` of requests meet ``slo`` at
    ``total_rate`` requests/s, each replica simulated at ``total_rate / N``. Replica counts are
    tried by doubling, then the last gap is bisected."""
    if total_rate <= 0 or not 0.0 < target_attainment <= 1.0:
        raise ValueError("total_rate must be positive and target_attainment in (0, 1]")
    rows: dict[int, SweepRow] = {}

    def ok(n: int) -> bool:
        if n not in rows:
            w = dataclasses.replace(workload, request_rate=total_rate / n)
            rows[n] = SweepRow(n, summarize(simulate(w, sim, timer), slo))
        return rows[n].summary.slo_attainment >= target_attainment

    lo, hi = 0, 1
    while not ok(hi):
        lo = hi
        hi *= 2
        if hi > max_replicas:
            if not ok(max_replicas):
                return ReplicaPlan(None, [rows[k] for k in sorted(rows)])
            hi = max_replicas
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return ReplicaPlan(hi, [rows[k] for k in sorted(rows)])
