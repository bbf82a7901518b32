"""Are the 256-row decode GEMMs held back by the power cap? The shared-prefix preset's decode
step spends ~7.2 ms in bf16 GEMMs at 256 rows against a 4.9-5.0 ms roofline taken at the burst
clocks of the same-run ceiling. This script samples the SM clock and power (``nvidia-smi -lms
25``, as ``gpu_clocks.py``) while it runs:

* ``gemms``: the 8B's four GEMM shapes at 256 rows (qkv, o, gate_up, down; 32 layers' weights,
  so each GEMM reads its weight from HBM) captured in one CUDA graph: one replay after an idle
  pause (burst clocks), then replays back to back for ``--seconds`` (sustained), each with its
  TFLOP/s and the weight bytes' rate;
* ``preset``: the shared-prefix preset through the engine (``--presets``, default
  ``shared-prefix``), its decode and prefill phases' clocks and power.

    python scripts/gpu_power.py                     # ~1.5 min on one H100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_clocks  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MARKS: list[tuple[str, float, float]] = []


def gemms(rows: int, seconds: float) -> None:
    dev = torch.device("cuda")
    layers = 32
    ws = {n: [torch.randn(s, device=dev, dtype=BF16) * 0.02 for _ in range(layers)]
          for n, s in SHAPES.items()}  # fmt: skip
    xs = {n: torch.randn(rows, s[1], device=dev, dtype=BF16) for n, s in SHAPES.items()}
    flops = sum(2 * rows * s[0] * s[1] for s in SHAPES.values()) * layers
    nbytes = sum(2 * s[0] * s[1] for s in SHAPES.values()) * layers

    def step() -> None:
        for i in range(layers):
            for n in SHAPES:
                xs[n] @ ws[n][i].t()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()

    def timed() -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3

    time.sleep(2.0)
    t = time.time()
    first = timed()
    MARKS.append(("gemms after idle (1)", t, time.time()))
    t = time.time()
    walls = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        walls.append(timed())
    MARKS.append((f"gemms sustained {seconds:.0f} s", t, time.time()))
    med = statistics.median(walls[len(walls) // 2 :])
    for name, w in (("after idle", first), ("sustained (median, last half)", med)):
        print(f"{rows}-row GEMMs x {layers} layers, {name}: {w * 1e3:.3f} ms = "
              f"{flops / w / 1e12:.0f} TFLOP/s, weights {nbytes / w / 1e12:.2f} TB/s",
              flush=True)  # fmt: skip
    per = {}
    for n in SHAPES:  # each shape alone, sustained: one graph of its 32 GEMMs, 40 replays
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(layers):
                xs[n] @ ws[n][i].t()
        g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(40):
            g.replay()
        e1.record()
        e1.synchronize()
        per[n] = e0.elapsed_time(e1) / 1e3 / 40 / layers
    print("  per GEMM, each shape's graph back to back (us): "
          + ", ".join(f"{n} {t * 1e6:.1f}" for n, t in per.items()), flush=True)  # fmt: skip


def presets(names: list[str]) -> None:
    import gpu_presets as gp

    from roofline import LLM
    from roofline.bench.ceilings import measure

    ceil = measure(torch.device("cuda"), BF16)
    print(f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192)  # fmt: skip
    for name in names:
        gp.run_preset(llm, ceil, name, "warm-up")
        time.sleep(2.0)
        clock = _StampClock()
        t = time.time()
        gp.run_preset(llm, ceil, name)
        clock.close()
        MARKS.append((f"preset {name}", t, time.time()))
        for kind, spans in clock.spans().items():
            for i, (a, b) in enumerate(spans):
                MARKS.append((f"  {name} {kind} span {i}", a, b))
    for line in gp.ROWS:
        print(f"{line[0]}: {line[1]}", flush=True)


class _StampClock:
    """Wall-clock spans of runs of same-kind steps (decode / prefill), stamped as
    ``gpu_presets.PhaseClock`` sees each step scheduled, to split the preset's samples."""

    def __init__(self) -> None:
        import gpu_presets as gp

        self.stamps: list[tuple[float, str]] = []
        self._orig = gp.PhaseClock.__call__
        clock = self

        def call(phase_clock, sched_out):
            clock.stamps.append((time.time(), phase_clock.kind(sched_out)))
            return clock._orig(phase_clock, sched_out)

        gp.PhaseClock.__call__ = call

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        """kind -> [(start, end)] of each run of at least 10 steps of that kind."""
        out: dict[str, list[tuple[float, float]]] = {}
        runs: list[list] = []
        for t, kind in self.stamps:
            if runs and runs[-1][2] == kind:
                runs[-1][1], runs[-1][3] = t, runs[-1][3] + 1
            else:
                runs.append([t, t, kind, 1])
        for t0, t1, kind, n in runs:
            if n >= 10:
                out.setdefault(kind, []).append((t0, t1))
        return out

    def close(self) -> None:
        import gpu_presets as gp

        gp.PhaseClock.__call__ = self._orig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--presets", default="shared-prefix")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    proc = gpu_clocks.sampler("clocks_throttle_reasons.active")
    time.sleep(0.5)
    try:
        gemms(args.rows, args.seconds)
        torch.cuda.empty_cache()
        if args.presets:
            presets(args.presets.split(","))
    finally:
        gpu_clocks.report(proc, MARKS, "throttle reasons seen",
                          lambda why: " ".join(sorted(set(why))))  # fmt: skip


if __name__ == "__main__":
    main()
