"""Decode attention over 1-byte KV pages (fp8 e4m3, int8) widened to fp16 in registers
(``kernels/decode_attention.py`` ``KV_F16``) against the previous path (through fp32 to bf16),
on the GPU, in one process:

1. parity: each path against ``decode_attention_ref`` over the same quantized pages (Llama-3.1-8B
   heads, contexts 1..4,000, one split and several), with V scaled by 1e-3 and 1e3 too (the
   per-tile scale normalisation that keeps the probabilities in fp16's range);
2. the kernel alone at batch 32 x 8,192 (and 128 x 2,048): bf16 pages, then fp8 / int8 with
   the previous path and with fp16 widening over a few (BLOCK_N, warps, stages) configs, in GB/s
   of K/V + scales against the copy bandwidth measured here;
3. Llama-3.1-8B decode step at batch 32 with 8,192-token contexts (issue 11: fp8 KV >= 1.3x the
   bf16-KV step): bf16 KV, fp8 KV with the fastest fp16 config, fp8 KV with the previous path,
   int8 KV with the fastest.

    python scripts/gpu_kvf16.py [--quick]

A table last.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kvquant import _paged, _weight_bytes  # noqa: E402

from roofline import LLM  # noqa: E402
from roofline.bench import latency  # noqa: E402
from roofline.bench.ceilings import measure, time_fn  # noqa: E402
from roofline.kernels import decode_attention as da  # noqa: E402
from roofline.quantization.kv_cache import quantize  # noqa: E402

DEV = torch.device("cuda")
PAGES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
ROWS: list[tuple[str, str]] = []


def row(key: str, value: str) -> None:
    ROWS.append((key, value))
    print(f"{key:60s} {value}", flush=True)


def _run(args, kw, f16: bool, config=None, anchor: bool = True, **extra):
    saved = da.KV_F16, da.KV_ANCHOR
    da.KV_F16, da.KV_ANCHOR = f16, anchor
    try:
        return da.decode_attention(*args, config=config, **kw, **extra)
    finally:
        da.KV_F16, da.KV_ANCHOR = saved


def parity() -> None:
    q, kc, vc, table, _ = _paged(8, 4000, 32, 8, 128, 16, torch.bfloat16)
    seq_lens = torch.tensor([1, 17, 64, 129, 777, 1500, 3999, 4000], device=DEV).int()
    for v_mul in (1.0, 1e-3, 1e3):
        for name, dtype in PAGES.items():
            kq, ks = quantize(kc, dtype)
            vq, vs = quantize(vc * v_mul, dtype)
            args = (q, kq, vq, table, seq_lens, 0.088)
            kw = {"k_scale": ks, "v_scale": vs}
            ref = da.decode_attention_ref(*args, ks, vs).float()
            errs = []
            for f16, cfg in ((False, None), (True, None), (True, (128, 4, 2))):
                for splits in (1, 4):
                    out = _run(args, kw, f16, cfg, num_splits=splits).float()
                    rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    errs.append(f"{'f16' if f16 else 'old'}{cfg or ''}/{splits}: {rel:.1e}")
            row(f"parity {name} V x{v_mul:g} (max err / max|ref|)", ", ".join(errs))


def _rate(t: float, nbytes: int, ceil) -> str:
    pct = 100 * nbytes / t / ceil.bandwidth_bytes_per_s
    return f"{t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s ({pct:.0f}% of copy)"


def kernel_bench(ceil, quick: bool) -> dict:
    best = {}
    configs = [(128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (256, 4, 2), (256, 8, 2),
               (128, 8, 2), (128, 8, 3), (64, 2, 2), (128, 2, 2), (32, 4, 3)]  # fmt: skip
    if quick:
        configs = configs[:3]
    for b, ctx in ((32, 8192), (128, 2048)):
        q, kc, vc, table, seq_lens = _paged(b, ctx, 32, 8, 128, 16, torch.bfloat16)
        bf16_args = (q, kc, vc, table, seq_lens, 0.088)
        t = time_fn(lambda a=bf16_args, n=ctx: da.decode_attention(*a, max_seq_len=n), DEV,
                    iters=20)  # fmt: skip
        row(f"kernel b{b} x {ctx} bf16 (default)", _rate(t, 2 * kc.numel() * 2, ceil))
        for name, dtype in PAGES.items():
            kq, ks = quantize(kc, dtype)
            vq, vs = quantize(vc, dtype)
            args = (q, kq, vq, table, seq_lens, 0.088)
            kw = {"k_scale": ks, "v_scale": vs, "max_seq_len": ctx}
            nbytes = 2 * (kq.numel() + ks.numel() * 4)
            runs = [(False, None, False), (True, (128, 4, 2), False)]
            runs += [(True, c, True) for c in configs]
            got = []
            for f16, cfg, anchor in runs:
                label = "previous" if not f16 else f"f16{' anchored' if anchor else ''} {cfg}"
                try:
                    t = time_fn(lambda a=args, k=kw, f=f16, c=cfg, h=anchor: _run(a, k, f, c, h),
                                DEV, iters=20)  # fmt: skip
                except Exception as e:  # (a config that does not compile: shared memory)
                    row(f"kernel b{b} x {ctx} {name} {label}", f"error {type(e).__name__}")
                    continue
                got.append((t, f16 and anchor, cfg))
                row(f"kernel b{b} x {ctx} {name} {label}", _rate(t, nbytes, ceil))
            f16_runs = [g for g in got if g[1]]
            if f16_runs:
                t, _, cfg = min(f16_runs)
                old = next(g[0] for g in got if not g[1])
                row(f"kernel b{b} x {ctx} {name} best f16", f"{cfg}: {t * 1e6:.1f} us, "
                    f"{old / t:.2f}x the previous path")  # fmt: skip
                best.setdefault(name, {})[(b, ctx)] = cfg
            del kq, vq, ks, vs
        del q, kc, vc
        gc.collect()
        torch.cuda.empty_cache()
    return best


def prefill_bench(ceil) -> None:
    """Prefill chunks over a cached context, the kernel as the backend calls it (the chunk's own
    keys through descriptors over 16-bit pages): bf16 pages against fp8 / int8 pages (the paged
    kernel, dequantizing in registers), the quantized ones over a few tile configs
    (``QUANT_TILES``), each against ``prefill_attention_ref`` on a small batch first."""
    from roofline.kernels import prefill_attention as pa

    q, kc, vc, table, _ = _paged(3, 1200, 32, 8, 128, 16, torch.bfloat16)
    seq_lens = torch.tensor([1200, 700, 333], device=DEV).int()
    qsl = torch.tensor([0, 400, 900, 1233], device=DEV).int()
    qp = torch.randn(1233, 32, 128, device=DEV, dtype=torch.bfloat16)
    for name, dtype in PAGES.items():
        (kq, ks), (vq, vs) = quantize(kc, dtype), quantize(vc, dtype)
        args = (qp, kq, vq, table, qsl, seq_lens, 0.088)
        ref = pa.prefill_attention_ref(*args, ks, vs).float()
        for cfg in QUANT_TILES:
            pa.QUANT_TILES = cfg
            out = pa.prefill_attention(*args, 500, k_scale=ks, v_scale=vs).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            row(f"prefill parity {name} {cfg}", f"max err / max|ref| {err:.1e}")
        pa.QUANT_TILES = None
    for reqs, chunk, ctx in ((1, 2048, 10240), (16, 512, 2560), (1, 8192, 8192)):
        q, kc, vc, table, seq_lens = _paged(reqs, ctx, 32, 8, 128, 16, torch.bfloat16)
        q = torch.randn(reqs * chunk, 32, 128, device=DEV, dtype=torch.bfloat16)
        k_new = torch.randn(reqs * chunk, 8, 128, device=DEV, dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        qsl = torch.arange(0, reqs + 1, device=DEV, dtype=torch.int32) * chunk
        flops = 4 * reqs * chunk * (ctx - chunk / 2) * 32 * 128
        for name in ("bf16", *PAGES):
            kw = {"k_new": k_new, "v_new": v_new}
            pages = (kc, vc)
            if name != "bf16":
                (kq, ks), (vq, vs) = quantize(kc, PAGES[name]), quantize(vc, PAGES[name])
                pages = (kq, vq)
                kw.update(k_scale=ks, v_scale=vs)
            args = (q, *pages, table, qsl, seq_lens, 0.088, chunk)
            for cfg in [None] + (QUANT_TILES if name != "bf16" else []):
                pa.QUANT_TILES = cfg
                t = time_fn(lambda a=args, k=kw: pa.prefill_attention(*a, **k), DEV, iters=20)
                row(f"prefill {reqs} x {chunk} over {ctx - chunk} cached, {name} {cfg or ''}",
                    f"{t * 1e6:.0f} us, {flops / t / 1e12:.0f} TFLOP/s")  # fmt: skip
            pa.QUANT_TILES = None
        del q, kc, vc
        gc.collect()
        torch.cuda.empty_cache()


QUANT_TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 4, 2)]


def engine_prefill(ceil) -> None:
    """Llama-3.1-8B prefill through the engine (one token generated): an 8,000-token prompt and
    four 2,000-token ones, bf16 KV against fp8 KV with the fresh rows dequantized for the
    descriptor kernel (``triton_backend.DEQUANT_FRESH``) and without (same engine), warm runs,
    the median of three."""
    from roofline import SamplingParams
    from roofline.attention import triton_backend as tb

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for kv in ("auto", "fp8"):
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", kv_cache_dtype=kv,
                  max_model_len=8448, max_num_seqs=16, max_num_batched_tokens=8192)  # fmt: skip
        for fresh in (True, False) if kv == "fp8" else (True,):
            tb.DEQUANT_FRESH = fresh
            for n, length in ((1, 8000), (4, 2000)):
                times = []
                for rep in range(4):
                    llm.llm_engine.kv_manager.reset_prefix_cache()
                    prompts = [[(7 * i + 13 * j + rep) % 30000 + 100 for j in range(length)]
                               for i in range(n)]  # fmt: skip
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    llm.generate(prompts, one, use_tqdm=False)
                    times.append(time.perf_counter() - t0)
                t = sorted(times[1:])[1]
                label = (
                    kv if kv == "auto" else f"fp8, fresh rows {'dequantized' if fresh else 'paged'}"
                )
                row(f"8B prefill {n} x {length}, KV {label}", f"{1e3 * t:.1f} ms")
        tb.DEQUANT_FRESH = True
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def cascade(ceil) -> None:
    """Shared-prefix decode over 1-byte pages (``kernels/cascade_grouped.py`` with scales): the
    kernels at the shared-prefix preset's decode shape (B = 256, prefix 2,000, suffix 128)
    against plain decode over the same pages and bf16 pages' cascade, then the preset itself
    with fp8 KV, cascade on and off, beside bf16 KV (warm runs of one engine each)."""
    from gpu_presets import shared_batch

    from roofline.bench import throughput, workloads
    from roofline.kernels.cascade_grouped import grouped_cascade_attention

    b = shared_batch(256, 2000, 128)
    args = (b["table"], b["seq_lens"], b["pages"], b["prefix_len"], b["starts"], 128**-0.5)
    b["starts"][::7] = 0  # every 7th row not a member
    t = time_fn(lambda: grouped_cascade_attention(b["q"], b["kc"], b["vc"], *args), DEV, iters=30)
    row("cascade B256 prefix 2000 suffix 128, bf16 pages", f"{t * 1e6:.1f} us")
    for name, dtype in PAGES.items():
        (kq, ks), (vq, vs) = quantize(b["kc"], dtype), quantize(b["vc"], dtype)
        out = grouped_cascade_attention(b["q"], kq, vq, *args, k_scale=ks, v_scale=vs).float()
        ref = da.decode_attention_ref(b["q"], kq, vq, b["table"], b["seq_lens"], 128**-0.5, ks,
                                      vs).float()  # fmt: skip
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        t = time_fn(lambda k=kq, v=vq, a=ks, c=vs: grouped_cascade_attention(
            b["q"], k, v, *args, k_scale=a, v_scale=c), DEV, iters=30)  # fmt: skip
        tp = time_fn(lambda k=kq, v=vq, a=ks, c=vs: da.decode_attention(
            b["q"], k, v, b["table"], b["seq_lens"], 128**-0.5, k_scale=a, v_scale=c),
            DEV, iters=30)  # fmt: skip
        row(
            f"cascade B256 prefix 2000 suffix 128, {name} pages",
            f"{t * 1e6:.1f} us (plain decode {tp * 1e6:.1f}); max err / max|ref| {err:.1e}",
        )
    b.clear()  # (the batch's memory back before the engines)
    gc.collect()
    torch.cuda.empty_cache()
    for kv, on in (("auto", True), ("fp8", True), ("fp8", False)):
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", kv_cache_dtype=kv,
                  max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192,
                  cascade_attention=on)  # fmt: skip
        wl = workloads.preset("shared-prefix", llm.llm_engine.model_config.vocab_size)
        runs = []
        for _ in range(2):
            llm.llm_engine.kv_manager.reset_prefix_cache()
            runs.append(throughput.run(llm, ceil, wl, use_tqdm=False))
        r = runs[-1]
        row(f"shared-prefix preset, KV {kv}, cascade {'on' if on else 'off'}",
            f"{r.elapsed_s:.3f} s (first {runs[0].elapsed_s:.3f}), {r.roofline_pct:.1f}% of its "
            f"roofline, {len(r.jit_compiles)} JIT compiles")  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def verify(ceil) -> None:
    """Speculative verification over 1-byte pages (``kernels/verify_attention.py``, 4 rows a
    request: 1 + 3 drafts), batch 32 x 8,192: bf16 pages, then fp8 / int8 through fp32 (the
    previous path) and widened to fp16 (``KV_F16``), each against the reference first."""
    from roofline.kernels.verify_attention import verify_attention, verify_attention_ref

    qlen = 4
    q, kc, vc, table, seq_lens = _paged(32, 8192, 32, 8, 128, 16, torch.bfloat16)
    q = torch.randn(32 * qlen, 32, 128, device=DEV, dtype=torch.bfloat16)
    base = (table, seq_lens, 0.088, qlen)
    t = time_fn(lambda: verify_attention(q, kc, vc, *base, max_seq_len=8192), DEV, iters=20)
    row("verify b32 x 8192, 4 rows, bf16 pages", _rate(t, 2 * kc.numel() * 2, ceil))
    for name, dtype in PAGES.items():
        (kq, ks), (vq, vs) = quantize(kc, dtype), quantize(vc, dtype)
        nbytes = 2 * (kq.numel() + ks.numel() * 4)
        for f16 in (False, True):
            da.KV_F16 = f16
            out = verify_attention(q[:8], kq, vq, table[:2], seq_lens[:2], 0.088, qlen,
                                   max_seq_len=8192, k_scale=ks, v_scale=vs).float()  # fmt: skip
            ref = verify_attention_ref(q[:8], kq, vq, table[:2], seq_lens[:2], 0.088, qlen,
                                       k_scale=ks, v_scale=vs).float()  # fmt: skip
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            t = time_fn(lambda a=kq, b=vq, c=ks, d=vs: verify_attention(
                q, a, b, *base, max_seq_len=8192, k_scale=c, v_scale=d), DEV, iters=20)  # fmt: skip
            row(f"verify b32 x 8192, 4 rows, {name} {'f16' if f16 else 'previous'}",
                f"{_rate(t, nbytes, ceil)}; max err / max|ref| {err:.1e}")  # fmt: skip
        da.KV_F16 = True


def decode_step(ceil, best: dict) -> None:
    runs = [("auto", True, None, None), ("fp8", True, None, None), ("fp8", False, None, None),
            ("int8", True, None, None)]  # fmt: skip
    runs += [("fp8", True, c, None) for c in CONFIGS] + [("auto", True, None, "again")]
    steps = {}
    for kv, f16, cfg, again in runs:
        da.KV_F16, da.QUANT_CONFIG = f16, cfg
        t0 = time.perf_counter()
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", kv_cache_dtype=kv,
                  max_model_len=8320, max_num_seqs=32, max_num_batched_tokens=16384,
                  gpu_memory_utilization=0.92)  # fmt: skip
        engine = llm.llm_engine
        res = min(
            (latency.run_batch(engine, ceil, 32, 8192, 48) for _ in range(2)),
            key=lambda r: r.step_ms_p50,
        )  # (the faster of two runs)
        cfg_m = engine.model_config
        spec = engine.runner.kv_spec
        kv_bytes = 32 * (8192 + 24) * spec.bytes_per_token(
            cfg_m.num_hidden_layers, cfg_m.num_key_value_heads, cfg_m.head_dim)  # fmt: skip
        roof = (_weight_bytes(llm) + kv_bytes) / ceil.bandwidth_bytes_per_s * 1e3
        way = f" f16 {cfg or 'default'}" if f16 else " previous"
        label = kv + (f" {again or ''}".rstrip() if kv == "auto" else way)
        steps[label] = res.step_ms_p50
        row(f"8B decode step b32 x 8k, KV {label}",
            f"{res.step_ms_p50:.2f} ms (p90 {res.step_ms_p90:.2f}), roofline {roof:.2f} ms = "
            f"{100 * roof / res.step_ms_p50:.0f}%; engine {time.perf_counter() - t0:.0f} s",
        )  # fmt: skip
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    bf16 = [ms for label, ms in steps.items() if label.startswith("auto")]
    base = sum(bf16) / len(bf16)  # (bf16 KV before and after the others)
    for label, ms in steps.items():
        if not label.startswith("auto"):
            row(f"speed-up vs bf16 KV: {label}", f"{base / ms:.3f}x (goal fp8 >= 1.3x)")
    da.KV_F16, da.QUANT_CONFIG = True, None


CONFIGS: list[tuple[int, int, int]] = []
"""(BLOCK_N, warps, stages) the engine section also runs fp8 KV with (``--configs``)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="parity,kernels,engine",
                    help="of parity, kernels, engine, prefill, offline")  # fmt: skip
    ap.add_argument("--configs", default="", help="e.g. 128/4/3,64/4/3: more fp8 engine runs")
    args = ap.parse_args()
    CONFIGS.extend(tuple(int(x) for x in c.split("/")) for c in args.configs.split(",") if c)
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    row("copy bandwidth", f"{ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s")
    best: dict = {}
    for name in args.sections.split(","):
        try:
            if name == "parity":
                parity()
            elif name == "kernels":
                best = kernel_bench(ceil, args.quick)
            elif name == "engine":
                decode_step(ceil, best)
            elif name == "prefill":
                prefill_bench(ceil)
            elif name == "engine_prefill":
                engine_prefill(ceil)
            elif name == "cascade":
                cascade(ceil)
            elif name == "verify":
                verify(ceil)
            elif name == "offline":  # gpu_kvquant's fixed-budget section (its own summary)
                import gpu_kvquant

                gpu_kvquant.concurrency(ceil, 8.0)
                for key, value in gpu_kvquant.SUMMARY.items():
                    row(f"offline at 8 GiB of KV: {key}", str(value))
        except Exception as e:  # the next section still runs
            import traceback

            traceback.print_exc()
            row(f"{name} error", f"{type(e).__name__}: {e}")
    print(f"\n=== gpu_kvf16 summary ({time.perf_counter() - t0:.0f} s)")
    for k, v in ROWS:
        print(f"{k:60s} {v}")


if __name__ == "__main__":
    main()
