"""The prefill half of ``scripts/gpu_startup.py`` (imported by it, not run alone): the 8192-token
prefill and 2,048-token chunks over an 8k cached prefix through the whole Llama-3.1-8B (% of the
matmul rate, kernel time by op, the step's timeline), the attention kernels alone beside cuDNN, the
step's GEMM shapes alone, batch-1 decode; and the shared section runner and summary."""

from __future__ import annotations

import collections
import time

from gpu_common import sections  # scripts/ is on sys.path when run as a script

SUMMARY: list[tuple[str, str]] = []


section = sections(
    lambda name, e: SUMMARY.append((name, "FAILED")), footer="--- {name}: {seconds:.1f} s"
)


def run_child(cmd: list[str], timeout_s: float) -> None:
    """Run a child process (a fresh engine), echo its last lines, and take its ``SUMMARY name ::
    value`` lines into ``SUMMARY``."""
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    print("\n".join("  " + ln for ln in lines[-30:]), flush=True)
    if done.returncode:
        print(done.stderr[-3000:], flush=True)
    for ln in lines:
        if ln.startswith("SUMMARY "):
            name, _, value = ln[8:].partition(" :: ")
            SUMMARY.append((name, value))


def timed_generate(llm, prompts_fn, n: int = 3) -> float:  # noqa: ANN001
    """Median wall seconds of ``llm.generate`` (one output token) over ``n`` prompts."""
    import torch

    from roofline import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i in range(n):
        prompt = prompts_fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_split(llm, prompt: list[int]) -> tuple[float, dict[str, float]]:  # noqa: ANN001
    """(wall s, device ms per op group) of one generate of ``prompt`` under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    groups = {"attention": ("_prefill", "sdpa", "fmha", "flash"), "rmsnorm": ("rms_norm",),
              "rope+kv store": ("rotary", "kv_store", "store_kv"), "silu*mul": ("silu",),
              "prefix gather": ("index_select", "indexselect", "index_kernel"),
              "GEMM": ("gemm", "nvjet", "cutlass", "sm90", "xmma", "skinny")}  # fmt: skip
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    totals: dict[str, float] = collections.defaultdict(float)
    per_name: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            low = e.name.lower()
            g = next((g for g, keys in groups.items() if any(k in low for k in keys)), "other")
            totals[g] += e.device_time / 1e3
            per_name[e.name[:70]] += e.device_time / 1e3
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:10]
    print("    top kernels (ms): " + "; ".join(f"{n} {t:.1f}" for n, t in top))
    return wall, dict(totals)


def step_timeline(llm, prompt: list[int], label: str) -> None:  # noqa: ANN001
    """Where one generate's wall time goes: host work before the step is launched, the host's
    launch of it, the device's span from the launch's first to its last queued work (events),
    and what follows on the host (waiting included)."""
    import torch

    from roofline import SamplingParams
    from roofline.worker.model_runner import ModelRunner

    params = SamplingParams(max_tokens=1, temperature=0.0)
    marks: dict[str, object] = {}
    original = ModelRunner.launch_batch

    def launch_batch(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if "enter" in marks:  # the step's first launch only
            return original(self, *args, **kwargs)
        marks["enter"] = time.perf_counter()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        out = original(self, *args, **kwargs)
        ev1.record()
        marks["exit"], marks["events"] = time.perf_counter(), (ev0, ev1)
        return out

    ModelRunner.launch_batch = launch_batch
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        ModelRunner.launch_batch = original
    ev0, ev1 = marks["events"]
    span = ev0.elapsed_time(ev1)  # ms
    pre = (marks["enter"] - t0) * 1e3
    launch = (marks["exit"] - marks["enter"]) * 1e3
    print(f"  {label} timeline: wall {wall * 1e3:.1f} ms = host before the launch {pre:.1f} + "
          f"device span {span:.1f} (the host launched it in {launch:.1f}) + after "
          f"{wall * 1e3 - pre - span:.1f}", flush=True)  # fmt: skip


def print_split(label: str, wall: float, totals: dict[str, float]) -> None:
    total = sum(totals.values())
    parts = ", ".join(f"{g} {t:.1f}" for g, t in sorted(totals.items(), key=lambda kv: -kv[1]))
    print(f"  {label}: wall {wall * 1e3:.1f} ms (profiled), kernels {total:.1f} ms: {parts}; "
          f"not covered by kernels {wall * 1e3 - total:.1f} ms", flush=True)  # fmt: skip


@section("prefill: Llama-3.1-8B, 8192 tokens and 2048-token chunks over an 8k cached prefix")
def prefill_section(llm, ceil, quick: bool) -> None:  # noqa: ANN001
    from roofline.kernels import prefill_attention as pa
    from roofline.kernels import prefix_gather
    from roofline.planner.roofline import step_cost

    cfg = llm.llm_engine.model_config
    gpu = ceil.as_gpu_spec()
    rate = ceil.matmul_flops_per_s
    base = list(range(100, 100 + 8192))
    llm.generate([base[:512]], None, use_tqdm=False)  # compiles, allocator
    cost = step_cost(cfg, gpu, num_prefill_tokens=8192)

    def fresh(i: int) -> list[int]:
        llm.llm_engine.kv_manager.reset_prefix_cache()
        return [5 + i] + base[1:]

    # "base": the paged kernel, what the split (mixed-step) path ran before this branch
    variants = ["tma_hf", "base"]
    if not quick:
        variants += ["tma_ws_hf", "tma"]
    default = pa.DEFAULT_VARIANT
    for variant in variants:
        pa.DEFAULT_VARIANT = variant
        try:
            timed_generate(llm, fresh, 1)  # this variant's compiles
            t = timed_generate(llm, fresh)
        except Exception as e:  # noqa: BLE001
            print(f"  8192-token prefill, {variant}: {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            pa.DEFAULT_VARIANT = default
        pct = 100 * cost.flops / t / rate
        print(f"  8192-token prefill, {variant}: {t * 1e3:.1f} ms, {cost.flops / t / 1e12:.0f} "
              f"TFLOP/s = {pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B prefill 8192 ({variant})", f"{t * 1e3:.0f} ms, {pct:.1f}% of matmul"))
    print_split("8192 fresh", *kernel_split(llm, fresh(7)))
    step_timeline(llm, fresh(8), "8192 fresh")

    # 2048-token chunks over a cached 8192-token prefix (a prefix-cache hit: one step each)
    chunk_cost = step_cost(cfg, gpu, prefill_chunks=[(2048, 8192)])
    llm.llm_engine.kv_manager.reset_prefix_cache()
    llm.generate([base], None, use_tqdm=False)  # the prefix, cached

    fresh_suffixes = iter(range(20000, 120000, 2100))  # each chunk new: no prefix hit past 8k

    def chunk(i: int) -> list[int]:
        start = next(fresh_suffixes)
        return base + list(range(start, start + 2048))

    min_query_len = prefix_gather.MIN_QUERY_LEN
    for label, min_q, variant in (
        ("prefix gathered (TMA)", min_query_len, default),
        ("prefix from the pages", 1 << 30, default),
        ("all from the pages (before)", 1 << 30, "base"),
    ):
        prefix_gather.MIN_QUERY_LEN = min_q
        pa.DEFAULT_VARIANT = variant
        try:
            timed_generate(llm, chunk, 1)
            t = timed_generate(llm, chunk)
        finally:
            prefix_gather.MIN_QUERY_LEN = min_query_len
            pa.DEFAULT_VARIANT = default
        pct = 100 * chunk_cost.flops / t / rate
        print(
            f"  2048-token chunk over 8192 cached, {label}: {t * 1e3:.1f} ms, "
            f"{chunk_cost.flops / t / 1e12:.0f} TFLOP/s = {pct:.1f}% of matmul",
            flush=True,
        )
        SUMMARY.append((f"8B chunk 2048 over 8k, {label}", f"{t * 1e3:.1f} ms, {pct:.1f}%"))
    print_split("2048 chunk over 8k", *kernel_split(llm, chunk(9)))
    step_timeline(llm, chunk(10), "2048 chunk over 8k")


@section("attention alone: 2048-token chunk over an 8192-token paged prefix (32/8 heads, d 128)")
def chunk_attention_section() -> None:
    import torch

    from roofline.bench.ceilings import time_fn
    from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention
    from roofline.kernels.prefix_gather import gather_prefix, plan_prefix

    dev = torch.device("cuda")
    h, hk, d, ps, ctx, n = 32, 8, 128, 16, 8192, 2048
    total = ctx + n
    pages = torch.randperm(total // ps, device=dev, dtype=torch.int32)
    kc = torch.randn(total // ps, ps, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(n, h, d, device=dev, dtype=torch.bfloat16)
    bt = pages[None]
    k_new = kc[pages[ctx // ps :].long()].reshape(n, hk, d)
    v_new = vc[pages[ctx // ps :].long()].reshape(n, hk, d)
    qsl = torch.tensor([0, n], device=dev, dtype=torch.int32)
    sl = torch.tensor([total], device=dev, dtype=torch.int32)
    flops = causal_attention_flops([total], [n], h, d)
    args = (q, kc, vc, bt, qsl, sl, d**-0.5, n)
    plan = plan_prefix(bt, [total], [n], ps)
    pref = gather_prefix(plan, kc, vc)
    ref = prefill_attention(*args, k_new=k_new, v_new=v_new)
    out = prefill_attention(*args, k_new=k_new, v_new=v_new, prefix=pref)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"  gathered vs paged prefix: max abs diff {err:.3g}")
    runs = {
        "paged prefix (TMA chunk)": lambda: prefill_attention(*args, k_new=k_new, v_new=v_new),
        "gathered prefix, kernel only": lambda: prefill_attention(
            *args, k_new=k_new, v_new=v_new, prefix=pref
        ),
        "gathered prefix + the gather": lambda: prefill_attention(
            *args, k_new=k_new, v_new=v_new, prefix=gather_prefix(plan, kc, vc)
        ),
    }
    for name, fn in runs.items():
        t = time_fn(fn, dev, iters=10)
        print(f"  {name}: {t * 1e6:.0f} us, {flops / t / 1e12:.0f} TFLOP/s", flush=True)
        SUMMARY.append((f"chunk attention, {name}", f"{flops / t / 1e12:.0f} TF/s"))


@section("attention alone: 8192-token prompt in the model's layout (q/k/v views of one QKV row)")
def fresh_attention_section(quick: bool) -> None:
    import torch
    import torch.nn.functional as F

    from roofline.bench.ceilings import time_fn
    from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention

    dev = torch.device("cuda")
    h, hk, d, ps, n = 32, 8, 128, 16, 8192
    qkv = torch.randn(n, (h + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(n, h, d), k.view(n, hk, d), v.view(n, hk, d)  # strided, as in the model
    pages = torch.arange(n // ps, device=dev, dtype=torch.int32)
    kc, vc = k.reshape(n // ps, ps, hk, d).contiguous(), v.reshape(n // ps, ps, hk, d).contiguous()
    qsl = torch.tensor([0, n], device=dev, dtype=torch.int32)
    sl = torch.tensor([n], device=dev, dtype=torch.int32)
    flops = causal_attention_flops([n], [n], h, d)
    args = (q, kc, vc, pages[None], qsl, sl, d**-0.5, n)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, N, D] views
    backends = torch.nn.attention.SDPBackend
    runs = {
        "ours, tma_hf": lambda: prefill_attention(*args, k_new=k, v_new=v, variant="tma_hf"),
    }
    if not quick:
        runs["ours, tma_ws_hf"] = lambda: prefill_attention(
            *args, k_new=k, v_new=v, variant="tma_ws_hf"
        )
    sdpa = {
        "SDPA flash, gqa views": (backends.FLASH_ATTENTION, False),
        "SDPA cudnn, gqa views": (backends.CUDNN_ATTENTION, False),
        "SDPA cudnn, K/V repeated": (backends.CUDNN_ATTENTION, True),
    }
    if quick:
        sdpa.pop("SDPA flash, gqa views")
    for name, (backend, repeat) in sdpa.items():

        def run(backend=backend, repeat=repeat) -> torch.Tensor:
            kk, vv = kh, vh
            if repeat:
                kk, vv = (t.repeat_interleave(h // hk, dim=1) for t in (kh, vh))
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True,
                                                      enable_gqa=not repeat)  # fmt: skip

        runs[name] = run
    ref = prefill_attention(*args, k_new=k, v_new=v)
    for name, fn in runs.items():
        try:
            out = fn()
            if out.dim() == 4:
                out = out[0].transpose(0, 1)
            err = (out.float() - ref.float()).abs().max().item()
            t = time_fn(fn, dev, iters=10)
            tf = flops / t / 1e12
            print(f"  {name}: {t * 1e3:.2f} ms, {tf:.0f} TFLOP/s (max diff {err:.2g})", flush=True)
            SUMMARY.append((f"8k attention, {name}", f"{flops / t / 1e12:.0f} TF/s"))
        except Exception as e:  # noqa: BLE001 - a backend torch cannot run here
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)


@section("GEMMs of the prefill step alone (cuBLAS through torch), 8192 and 2048 rows")
def gemm_section(ceil) -> None:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    from roofline.bench.ceilings import time_fn

    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
              ("down", 4096, 14336)]  # fmt: skip
    for rows in (8192, 2048):
        parts = []
        for name, n, k in shapes:
            a = torch.randn(rows, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt)
            t = time_fn(lambda a=a, w=w: F.linear(a, w), dev, iters=10)
            tf = 2 * rows * n * k / t / 1e12
            parts.append(f"{name} {tf:.0f} ({100 * tf * 1e12 / ceil.matmul_flops_per_s:.0f}%)")
            del a, w
        print(f"  {rows} rows, TFLOP/s: " + ", ".join(parts), flush=True)
        SUMMARY.append((f"prefill GEMMs at {rows} rows", ", ".join(parts)))


@section("decode: Llama-3.1-8B batch 1 (regression: >= 169 tok/s)")
def decode_section(llm, ceil) -> None:  # noqa: ANN001
    from roofline.bench import latency

    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    SUMMARY.append(("8B batch-1 decode", f"{rows[0].output_tok_s:.1f} tok/s"))
