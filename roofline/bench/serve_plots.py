"""PNG plots of a ``roofline bench serve`` run: latency distributions (TTFT, TPOT, ITL,
end-to-end, with p50/p99 marks), output-token throughput and requests in flight over time, and
for a sweep the throughput-latency curve. matplotlib is imported here only (the ``bench``
extra), with the Agg backend, so benchmarks run on machines without a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from roofline.bench.serve_load import RequestResult  # noqa: E402


def _hist(ax: Any, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 2)), color="tab:blue", alpha=0.8)
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(values_ms, q))
        ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:.1f}")
    ax.legend(fontsize=8)


def plot_run(
    results: list[RequestResult], run: dict[str, Any], out_dir: Path, tag: str = ""
) -> list[Path]:
    """Write ``latency{tag}.png`` and ``timeline{tag}.png``; return their paths."""
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _hist(axes[0][0], [r.ttft * 1e3 for r in ok if r.ttft is not None], "TTFT")
    _hist(axes[0][1], [t * 1e3 for r in ok if (t := r.tpot) is not None], "TPOT")
    _hist(axes[1][0], [x * 1e3 for r in ok for x in r.itls], "ITL")
    _hist(axes[1][1], [r.e2e * 1e3 for r in ok], "end-to-end latency")
    fig.suptitle(f"latency, rate {run['request_rate']}, {run['completed']} requests")
    fig.tight_layout()
    latency = out_dir / f"latency{tag}.png"
    fig.savefig(latency, dpi=100)
    plt.close(fig)

    tl = run["timeline"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(tl["time_s"], tl["output_tokens_per_s"], color="tab:green")
    top.set_ylabel("output tokens / s")
    top.set_title("throughput over time")
    bottom.step(tl["time_s"], tl["running_requests"], where="mid", color="tab:purple")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since start")
    fig.tight_layout()
    timeline = out_dir / f"timeline{tag}.png"
    fig.savefig(timeline, dpi=100)
    plt.close(fig)
    return [latency, timeline]


def plot_sweep(runs: list[dict[str, Any]], path: Path) -> Path:
    """Throughput (x) against TTFT and TPOT percentiles (y), one point per rate."""
    xs = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for p, marker in (("p50", "o-"), ("p99", "s--")):
            ys = [r[key][p] if r[key][p] is not None else float("nan") for r in runs]
            ax.plot(xs, ys, marker, label=p)
        for x, r in zip(xs, runs, strict=True):
            ax.annotate(f"rate {r['request_rate']}", (x, r[key]["p50"] or 0), fontsize=7)
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
