"""PNG plots of simulated runs (matplotlib, Agg backend, imported only when a plot is asked for).

``plot_timeline`` draws KV usage, running/waiting requests and cumulative preemptions against
the virtual clock; ``plot_latency_cdf`` the TTFT, TPOT and end-to-end distributions;
``plot_sweep`` throughput, goodput and latency percentiles against the swept request rate or
replica count.
"""

from __future__ import annotations

import os
from typing import Any

from roofline.planner.metrics import SweepRow
from roofline.planner.simulator import SimResult


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'roofline[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: SimResult, path: str | os.PathLike[str], title: str = "") -> None:
    plt = _pyplot()
    t = [p.time_s for p in result.timeline]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [100 * p.kv_usage for p in result.timeline], lw=1)
    axes[0].set_ylabel("KV usage (%)")
    axes[0].set_ylim(0, 105)
    axes[1].plot(t, [p.num_running for p in result.timeline], lw=1, label="running")
    axes[1].plot(t, [p.num_waiting for p in result.timeline], lw=1, label="waiting")
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, [p.num_preemptions_total for p in result.timeline], lw=1, color="C3")
    axes[2].set_ylabel("preemptions (total)")
    axes[2].set_ylim(bottom=0)
    axes[2].set_xlabel("time (s, simulated)")
    fig.suptitle(title or "simulated serving timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(result: SimResult, path: str | os.PathLike[str], title: str = "") -> None:
    plt = _pyplot()
    done = [r for r in result.requests if r.finish_s is not None]
    series = {
        "TTFT (ms)": [1e3 * r.ttft_s for r in done],
        "TPOT (ms)": [1e3 * t for t in (r.tpot_s for r in done) if t is not None],
        "E2E (s)": [r.e2e_s for r in done],
    }
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (label, values) in zip(axes, series.items(), strict=False):
        values = sorted(values)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "latency distributions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[SweepRow], path: str | os.PathLike[str], x_label: str) -> None:
    plt = _pyplot()
    xs = [r.x for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(xs, [r.summary.output_tokens_per_s for r in rows], "o-")
    axes[0].set_ylabel("output tok/s")
    axes[1].plot(xs, [r.summary.request_throughput for r in rows], "o-", label="throughput")
    axes[1].plot(xs, [r.summary.goodput_rps for r in rows], "s--", label="goodput")
    axes[1].set_ylabel("requests/s")
    axes[1].legend()
    for p, style in ((50, "o-"), (99, "s--")):
        axes[2].plot(xs, [1e3 * r.summary.ttft_s[p] for r in rows], style, label=f"TTFT p{p}")
        axes[2].plot(xs, [1e3 * r.summary.tpot_s[p] for r in rows], style, label=f"TPOT p{p}")
    axes[2].set_ylabel("ms")
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
