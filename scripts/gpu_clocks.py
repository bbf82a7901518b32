"""Is the 8192-token prefill judged against a matmul rate it can hold? The same-run matmul
ceiling (``bench.ceilings.measure``: 10 synchronised 8192^3 GEMMs, ~15 ms of work) runs at the
GPU's burst clocks; a prefill step is ~220 ms of back-to-back GEMMs. This script samples the SM
clock and power (``nvidia-smi -lms``) while it runs: the ceiling as measured, then 8192^3 GEMMs
back to back for 2 s (the rate per 100 ms window), then 8192-token prefills of the dummy 8B.
Run from the repo root: ``python scripts/gpu_clocks.py`` (~1 min on one H100)."""

from __future__ import annotations

import datetime
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from roofline.bench.ceilings import measure


def sampler(extra: str = "temperature.gpu") -> subprocess.Popen:
    """``nvidia-smi`` sampling every 25 ms: time, SM clock, power and ``extra``."""
    query = f"timestamp,clocks.sm,power.draw,{extra}"
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "25"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen, marks: list, extra_name: str, extra: Callable) -> None:
    """Stop ``sampler`` and print, per phase of ``marks`` ((name, start, end) in unix time), the
    SM clock (median, min), the power (median, max) and ``extra`` of the phase's values of the
    extra field (as text), headed ``extra_name``."""
    time.sleep(0.3)
    proc.terminate()
    stamps = []
    for line in proc.communicate()[0].splitlines():
        try:
            ts, clk, pw, more = (x.strip() for x in line.split(","))
            when = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            stamps.append((when, float(clk), float(pw), more))
        except ValueError:
            continue
    print(f"\n{len(stamps)} samples; per phase: SM clock MHz (median, min), power W (median, "
          f"max), {extra_name}")  # fmt: skip
    for name, t0, t1 in marks:
        rows = [st[1:] for st in stamps if t0 <= st[0] <= t1]
        if not rows:
            print(f"  {name}: no samples")
            continue
        clk, pw = [r[0] for r in rows], [r[1] for r in rows]
        print(f"  {name:<34} n {len(rows):3}  clock {statistics.median(clk):6.0f} (min "
              f"{min(clk):5.0f})  power {statistics.median(pw):5.0f} (max {max(pw):5.0f})  "
              f"{extra([r[2] for r in rows])}", flush=True)  # fmt: skip


MARKS: list[tuple[str, float, float]] = []


def phase(name: str, t0: float) -> None:
    MARKS.append((name, t0, time.time()))


def main() -> None:
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    flops = 2 * 8192**3
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    time.sleep(2.0)  # cool down: the ceiling is usually measured on an idle GPU
    proc = sampler()
    time.sleep(0.5)
    t = time.time()
    ceil = measure(dev, torch.bfloat16)
    phase("ceiling (measure)", t)
    print(f"ceiling as measured: {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    t = time.time()
    rates = []
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:  # back to back, 100 ms windows
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(70):
            a @ b
        e1.record()
        e1.synchronize()
        rates.append(70 * flops / (e0.elapsed_time(e1) / 1e3) / 1e12)
    phase("sustained GEMMs 2 s", t)
    print("sustained 8192^3 GEMMs, TFLOP/s per ~100 ms window: "
          + " ".join(f"{r:.0f}" for r in rates), flush=True)  # fmt: skip
    print(f"sustained: first window {rates[0]:.0f}, median of the last half "
          f"{statistics.median(rates[len(rates) // 2:]):.0f} TFLOP/s", flush=True)  # fmt: skip
    from roofline import LLM, SamplingParams

    del a, b
    torch.cuda.empty_cache()
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=8448,
              max_num_seqs=256, max_num_batched_tokens=8192)  # fmt: skip
    base = list(range(100, 100 + 8192))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[3] + base[1:]], params, use_tqdm=False)
    time.sleep(2.0)
    t = time.time()
    walls = []
    for i in range(10):
        llm.llm_engine.kv_manager.reset_prefix_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([[5 + i] + base[1:]], params, use_tqdm=False)
        walls.append((time.perf_counter() - t0) * 1e3)
    phase("8192 prefills x10", t)
    print("8192 prefill walls (ms): " + " ".join(f"{w:.1f}" for w in walls), flush=True)
    from roofline.planner.roofline import step_cost

    cfg = llm.llm_engine.model_config
    cost = step_cost(cfg, ceil.as_gpu_spec(), num_prefill_tokens=8192)
    med = statistics.median(walls) / 1e3
    sustained = statistics.median(rates[len(rates) // 2 :]) * 1e12
    rate = cost.flops / med
    print(f"8192 prefill median {med * 1e3:.1f} ms = {rate / 1e12:.0f} TFLOP/s: "
          f"{100 * rate / ceil.matmul_flops_per_s:.1f}% of the ceiling as measured, "
          f"{100 * rate / sustained:.1f}% of the sustained GEMM rate", flush=True)  # fmt: skip
    report(proc, MARKS, "temperature C (max)",
           lambda temps: f"temp max {max(float(t) for t in temps):3.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
