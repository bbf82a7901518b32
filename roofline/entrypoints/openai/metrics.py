"""Prometheus metrics of the server, named like vLLM's (``vllm:`` becomes ``roofline:``).

Gauges and counters are read from the engine's latest ``EngineStats`` at scrape time (a custom
collector, so cumulative engine counters are exported exactly as the engine counts them).
Latency histograms are fed by :class:`ServerMetrics`, the async engine's observer: it sees every
step's delta outputs as the engine core reports them (on the API process's reader thread, with
the core's clock) and tracks, per request, when tokens arrived. Each app gets
its own ``CollectorRegistry`` so several servers can live in one process (tests).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from roofline.outputs import RequestOutput

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# (metric name without the ``roofline:`` prefix, EngineStats field, help)
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache pages in use (0..1)."),
    (
        "kv_cache_capacity_tokens",
        "kv_cache_capacity_tokens",
        "Tokens the KV pool holds (fp8/int8 pages: about twice the bf16 tokens).",
    ),
)
_COUNTERS = (
    ("num_preemptions", "num_preemptions_total", "Preemptions since start."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    (
        "prefix_cache_queries",
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
    ),
    ("prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    (
        "spec_decode_num_drafts",
        "spec_decode_num_drafts_total",
        "Speculative verifications (one per speculating request per step).",
    ),
    (
        "spec_decode_num_draft_tokens",
        "spec_decode_num_draft_tokens_total",
        "Tokens proposed for verification.",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_total",
        "Proposed tokens the target accepted.",
    ),
    (
        "spec_decode_num_emitted_tokens",
        "spec_decode_num_emitted_tokens_total",
        "Tokens emitted by verifications (accepted + the target's own).",
    ),
)


class _StatsCollector(Collector):
    def __init__(
        self, get_stats: Callable[[], Any], model_name: str, successes: Callable[[], dict[str, int]]
    ) -> None:
        self._get_stats = get_stats
        self._model_name = model_name
        self._successes = successes

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        labels = ["model_name"]
        for name, field, doc in _GAUGES:
            g = GaugeMetricFamily(f"roofline:{name}", doc, labels=labels)
            g.add_metric([self._model_name], float(getattr(stats, field, 0) if stats else 0))
            yield g
        for name, field, doc in _COUNTERS:
            c = CounterMetricFamily(f"roofline:{name}", doc, labels=labels)
            c.add_metric([self._model_name], float(getattr(stats, field, 0) if stats else 0))
            yield c
        c = CounterMetricFamily(
            "roofline:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposals by position in the proposal.",
            labels=["model_name", "position"],
        )
        for pos, count in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ())):
            c.add_metric([self._model_name, str(pos)], float(count))
        yield c
        c = CounterMetricFamily(
            "roofline:request_success",
            "Finished requests by reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(self._successes().items()):
            c.add_metric([self._model_name, reason], float(count))
        yield c


@dataclass
class _Tracked:
    arrival_time: float
    num_tokens: int = 0
    """Tokens so far, all completions together."""
    max_seq_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    """Tokens so far per completion index."""
    first_token_time: float | None = None
    last_token_time: float | None = None


class ServerMetrics:
    """Owns the registry; implements the async engine's ``EngineObserver``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._requests: dict[str, _Tracked] = {}
        self._successes: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self._stats: Any = None
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"roofline:{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between a request's consecutive engine steps that produced tokens.",
            _ITL_BUCKETS,
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.registry.register(
            _StatsCollector(lambda: self._stats, model_name, self._success_counts)
        )

    def _success_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._successes)

    # ------------------------------------------------------------ EngineObserver
    def on_stats(self, stats: Any) -> None:
        self._stats = stats

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Delta outputs of one step, made at ``now``."""
        with self._lock:
            for out in outputs:
                tracked = self._requests.get(out.request_id)
                if tracked is None:  # not added through the server, or already aborted
                    continue
                num_new = 0
                for c in out.outputs:
                    if c.token_ids:
                        num_new += len(c.token_ids)
                        seq = tracked.max_seq_tokens
                        seq[c.index] = seq.get(c.index, 0) + len(c.token_ids)
                if num_new:
                    if tracked.first_token_time is None:
                        first = out.metrics.first_token_time if out.metrics is not None else None
                        tracked.first_token_time = first if first is not None else now
                        self.ttft.labels(**self._labels).observe(
                            max(0.0, tracked.first_token_time - tracked.arrival_time)
                        )
                    elif tracked.last_token_time is not None:
                        self.itl.labels(**self._labels).observe(
                            max(0.0, now - tracked.last_token_time)
                        )
                    tracked.num_tokens += num_new
                    tracked.last_token_time = now
                if out.finished:
                    self._finish(out, tracked, now)

    def _finish(self, out: RequestOutput, tracked: _Tracked, now: float) -> None:
        del self._requests[out.request_id]
        m = out.metrics
        finished = m.finished_time if m is not None and m.finished_time is not None else now
        self.e2e.labels(**self._labels).observe(max(0.0, finished - tracked.arrival_time))
        if m is not None and m.first_scheduled_time is not None:
            self.queue.labels(**self._labels).observe(
                max(0.0, m.first_scheduled_time - tracked.arrival_time)
            )
        per_seq = max(tracked.max_seq_tokens.values(), default=0)
        if tracked.first_token_time is not None and per_seq > 1:
            self.tpot.labels(**self._labels).observe(
                max(0.0, finished - tracked.first_token_time) / (per_seq - 1)
            )
        reason = out.outputs[0].finish_reason if out.outputs else None
        if out.error is not None:
            reason = "error"
        key = reason or "abort"
        self._successes[key] = self._successes.get(key, 0) + 1

    def on_added(self, request_id: str, arrival_time: float) -> None:
        with self._lock:
            self._requests[request_id] = _Tracked(arrival_time)

    def on_aborted(self, request_id: str, now: float) -> None:
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self._successes["abort"] += 1
