"""The quantization GPU session in one process (H100, Llama-3.1-8B config, random weights).

``--quick`` is the decode check (``quant_decode_bench``): ``int4_gemv`` parity on the GPU (8B
shapes, groups 32/64/128, symmetric and not, bf16/fp16, M = 1/3/16, the SiLU prologue, the
repack round trip); per 8B shape at M = 1, 4, 16 the us, GB/s and % of copy of the bf16 skinny
GEMM, int8 ``quant_gemv``, int8 over ``int4_gemv``'s nibble planes, int4 ``quant_gemv`` and
int4 ``int4_gemv`` (with ``--sweep`` first: ``int4_gemv`` configs at M = 1/4/16, int8 planes at
M = 1, the SiLU-fused down projection; winners installed and printed as ``TUNED_CONFIGS``);
then 8B batch-1 decode for bf16, int8 and int4 (the fused decode layer: norms in the GEMVs'
prologues, residual adds in their epilogues; ``/unfused``: without it), each beside its
weight-bytes roofline, and a kernel profile of the int4 step.

The full run (no ``--quick``):

1. parity on the GPU: ``quant_gemv`` (the decode GEMV, its picked config) and the generic fused
   dequant GEMM against x times the exactly dequantized weight, down projection at M = 1 and 16
   (+ the SiLU-fused path); the Triton per-token fp8 quantization bit-exact against torch's;
   fp8 W8A8 on ``torch._scaled_mm``. (The sweep also checks every winning config's result.)
2. the decode config sweep: per method (int8 per channel, int4 g128, fp8) and 8B shape, at
   M = 1 (and 16 in the full run): us per GEMV and % of copy bandwidth for the generic kernel,
   ``quant_gemv``'s heuristic and every candidate config (unpack variants side by side), the
   bf16 skinny GEMM beside it; weights cycle through a ring of copies (>= 256 MiB) inside one
   CUDA graph, so no call is served from L2. Prints the ``TUNED_CONFIGS`` literal (also
   ``$OUT/quant_gemv_tuned.txt``) and installs it for the decode runs below;
3. per method: start-up, batch-1 decode tok/s beside its roofline (quantized weight bytes +
   scales + 16-bit LM head over the copy bandwidth); quick: int4, int8; full: bf16, int8, int4,
   fp8 at batch 1 and 128; fp8-w8a8 at batch 128 (variants ``int4/generic``: without
   ``quant_gemv``, ``int4/gemv256``: with it up to 256 rows, for A/B runs);
4. large M (quick: o / gate_up; full: every shape; M = 128, 256): bf16 cuBLAS vs
   the generic fused GEMM vs dequantize + cuBLAS vs ``quant_gemv`` row blocks vs fp8 W8A8;
5. (``--extra``) final-logits error vs bf16 per method; offline throughput fp8 W8A8 vs bf16.

Each section prints its error and goes on; a short table comes last.

    python scripts/gpu_quant.py --quick            # about 90 s
    python scripts/gpu_quant.py --quick --sweep    # about 2.5 min
    python scripts/gpu_quant.py                    # about 4 min
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import quant_decode_bench  # scripts/ is on sys.path when run as a script
import torch
import torch.nn.functional as F
import triton

from roofline import LLM
from roofline.bench import latency, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.bench.kernels import time_cuda
from roofline.kernels import quant_gemv
from roofline.kernels.activation import silu_and_mul_ref
from roofline.kernels.dequant_gemm import dequant_cublas_gemm, dequant_gemm, dequantize_ref
from roofline.kernels.fp8_quant import quantize_fp8_per_token
from roofline.kernels.gemv import skinny_gemm
from roofline.kernels.quant_gemv import QuantGemvConfig
from roofline.layers import fused_decode
from roofline.layers.linear import MergedLinear
from roofline.quantization import common, formats
from roofline.quantization.fp8 import _scaled_mm, w8a8_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
METHODS = ("int8", "int4", "fp8")
SUMMARY: dict[str, object] = {}
TABLE: list[str] = []
RING_BYTES = 256 << 20
DEVICE = "cuda"  # a CPU dry run (TRITON_INTERPRET=1) sets "cpu"


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                SUMMARY[f"{name}_error"] = repr(e)
            finally:
                print(f"({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
                gc.collect()
                torch.cuda.empty_cache()

        return run

    return wrap


def quantized(kind: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    if kind == "int8":
        q = formats.quantize_int8(w, k, torch.bfloat16)
        return q.qweight, q.scales, None
    if kind == "int4":
        return tuple(formats.quantize_int4(w, 128, False, torch.bfloat16))
    q, s = formats.quantize_fp8(w)
    return q, s, None


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def exact_ref(kind, x, qw, s, o) -> torch.Tensor:
    w = dequantize_ref(kind, qw, s, o, torch.float32)  # [N, K]
    return x.float() @ w.T


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


@section("kernel parity")
def parity(quick: bool) -> None:
    worst = 0.0
    for kind in METHODS:
        for layer, (n, k) in SHAPES.items():
            if quick and layer != "down":
                continue
            qw, s, o = quantized(kind, n, k)
            for m in (1, 16) if quick else (1, 4, 16):
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                ref = exact_ref(kind, x, qw, s, o)
                errs = {"generic": rel_err(dequant_gemm(kind, x, qw, s, o), ref)}
                picked = quant_gemv.pick_config(kind, m, n, k, x.device)
                unpacks = (0, 1) if kind == "int8" else (0, 1, 2)
                for unpack in (picked.unpack,) if quick else unpacks:
                    cfg = picked._replace(unpack=unpack)
                    got = quant_gemv.quant_gemv(kind, x, qw, s, o, config=cfg)
                    errs[f"gemv/u{unpack}"] = rel_err(got, ref)
                worst = max(worst, *errs.values())
                print(
                    f"{kind:5} {layer:8} M={m:2}: "
                    + " ".join(f"{a} {e:.1e}" for a, e in errs.items())
                )
            if layer == "down":
                gate_up = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
                ref = exact_ref(kind, silu_and_mul_ref(gate_up), qw, s, o)
                err = rel_err(quant_gemv.quant_gemv(kind, gate_up, qw, s, o, silu_mul=True), ref)
                worst = max(worst, err)
                print(f"{kind:5} down+silu_mul M=1 quant_gemv: {err:.1e}")
    x = torch.randn(64, 4096, device=DEVICE, dtype=torch.bfloat16) * 3
    q, sc = quantize_fp8_per_token(x)
    q_ref, sc_ref = formats.quantize_fp8_per_token(x)
    exact = torch.equal(q.float(), q_ref.float()) and torch.equal(sc, sc_ref)
    print(f"Triton per-token fp8 quantization bit-exact vs torch: {exact}")
    qw, s, _ = quantized("fp8", 4096, 4096)
    ref = w8a8_ref(x.float(), qw, s, None)
    err = rel_err(_scaled_mm(x, qw, s, None), ref)
    print(f"fp8 W8A8 _scaled_mm M=64 vs reference: {err:.2e}")
    SUMMARY["parity_worst_rel_err"] = max(worst, err)
    TABLE.append(
        f"parity: worst max-rel error {max(worst, err):.2e} (bf16 output rounding ~4e-3); "
        f"fp8 per-token quant exact: {exact}"
    )


time_graph = quant_decode_bench.time_graph  # one CUDA-graph timer for both scripts


def ring(kind: str, n: int, k: int) -> list[tuple]:
    qw, s, o = quantized(kind, n, k)
    copies = max(2, math.ceil(RING_BYTES / nbytes(qw, s, o)))
    return [(qw.clone(), s.clone(), None if o is None else o.clone()) for _ in range(copies)]


def candidates(kind: str, m: int, quick: bool) -> list[QuantGemvConfig]:
    """x_split 0/1 side by side for int4/int8 (fp8 loads x contiguously anyway); the int4
    16-bit-pair path (unpack 2) measured 3x slower at M = 1 on the H100 and is left out."""
    splits = (0, 1) if kind != "fp8" else (0,)
    if m == 1:
        unpacks = (0, 1, 2) if kind == "fp8" else (0, 1)
        bns, bks = ((8, 16), (512,)) if quick else ((8, 16, 32), (512, 1024))
        warps, stages = ((4,), (4,)) if quick else ((1, 4) if kind == "int4" else (4,), (4,))
    else:
        unpacks = {"int8": (0, 1), "int4": (1, 2), "fp8": (0, 1)}[kind]
        bns, bks = ((16, 32), (256,)) if quick else ((16, 32, 64), (256, 512))
        warps, stages = ((4,), (3,)) if quick else ((4, 8), (3,))
    return [
        QuantGemvConfig(bn, bk, w, st, u, 0, xs)
        for bn in bns for bk in bks for w in warps for st in stages for u in unpacks
        for xs in splits
        if kind == "int4" or bn * bk <= 16384  # whole-step tiles: fp32 products per thread
    ]  # fmt: skip


def precompile(fns: list) -> None:
    """Compile (first call) on a thread pool where Triton supports it; errors surface later."""
    if not hasattr(triton, "AsyncCompileMode"):
        return
    with (
        ThreadPoolExecutor(os.cpu_count() or 4) as pool,
        triton.AsyncCompileMode(pool, ignore_errors=True),
    ):
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - reported when the config is timed
                pass


def time_ring(fn, weights: list[tuple]) -> float:
    """Seconds per ``fn(*w)`` with w cycling through the ring (one CUDA graph)."""
    calls = max(len(weights), 8)
    return time_graph([partial(fn, *weights[i % len(weights)]) for i in range(calls)])


def sweep_one(
    kind: str, layer: str, m: int, weights: list, bf16_ring: list, copy_bw: float, quick: bool
):
    """Times the bf16 skinny GEMM, the generic kernel and every candidate config at one M;
    returns the best config."""
    qw0, s0, o0 = weights[0]
    n = qw0.shape[0]
    k = qw0.shape[1] * (2 if kind == "int4" else 1)
    q_bytes = nbytes(*weights[0])
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    t_bf16 = time_ring(partial(skinny_gemm, x), [(w,) for w in bf16_ring])
    t_old = time_ring(partial(dequant_gemm, kind, x), weights)
    heur = quant_gemv.heuristic_config(kind, n, k, m, 132)
    cfgs = [heur] + [c for c in candidates(kind, m, quick) if c != heur]
    gemv = partial(quant_gemv.quant_gemv, kind, x)
    precompile([partial(gemv, qw0, s0, o0, config=c, warmup=True) for c in cfgs])
    results = []
    for cfg in cfgs:
        try:
            results.append((time_ring(partial(gemv_with, gemv, cfg), weights), cfg))
        except Exception as e:  # noqa: BLE001
            print(f"  {kind} {layer} M={m} {tuple(cfg)}: {type(e).__name__}: {str(e)[:100]}")
    if not results:
        return None
    ref = exact_ref(kind, x, qw0, s0, o0)
    for t_best, best in sorted(results):  # the fastest config whose result is right
        err = rel_err(gemv(qw0, s0, o0, config=best), ref)
        if err < 2e-2:
            break
        print(f"      {tuple(best)} {t_best * 1e6:.1f} us is WRONG: max rel error {err:.2e}")
    else:
        return None
    t_heur = next((t for t, c in results if c == heur), float("nan"))

    def pct(t: float) -> float:
        return 100 * q_bytes / t / copy_bw

    print(
        f"{kind:5} {layer:8} M={m:2}: bf16 skinny {t_bf16 * 1e6:6.1f} us "
        f"({100 * 2 * n * k / t_bf16 / copy_bw:3.0f}%) | generic {t_old * 1e6:6.1f} us "
        f"({pct(t_old):3.0f}%) | gemv heuristic {t_heur * 1e6:6.1f} us ({pct(t_heur):3.0f}%) "
        f"| best {t_best * 1e6:6.1f} us ({pct(t_best):3.0f}%) {tuple(best)} err {err:.1e}",
        flush=True,
    )
    print("      top 5: " + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in sorted(results)[:5]))
    by_unpack: dict[int, float] = {}
    for t, c in results:
        by_unpack[c.unpack] = min(by_unpack.get(c.unpack, 1e9), t)
    print(
        "      best per unpack: "
        + ", ".join(f"u{u} {t * 1e6:.1f} us" for u, t in sorted(by_unpack.items()))
    )
    SUMMARY[f"sweep_{kind}_{layer}_{m}"] = {
        "bf16_us": t_bf16 * 1e6, "generic_us": t_old * 1e6, "heuristic_us": t_heur * 1e6,
        "best_us": t_best * 1e6, "best": tuple(best), "pct_copy": pct(t_best),
    }  # fmt: skip
    if m == 1:
        TABLE.append(
            f"GEMV {kind:4} {layer:7} M=1: generic {pct(t_old):3.0f}% -> best {pct(t_best):3.0f}% "
            f"of copy ({t_best * 1e6:.1f} us; bf16 {t_bf16 * 1e6:.1f} us)"
        )
    return best


def gemv_with(gemv, cfg: QuantGemvConfig, qw, s, o):
    return gemv(qw, s, o, config=cfg)


@section("decode GEMV sweep")
def sweep(copy_bw: float, quick: bool) -> None:
    tuned: dict[tuple, tuple] = {}
    for kind in METHODS:
        for layer, (n, k) in SHAPES.items():
            weights = ring(kind, n, k)
            copies = max(2, math.ceil(RING_BYTES / (2 * n * k)))
            bf16_ring = [
                torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies)
            ]
            for m in (1,) if quick else (1, 16):
                best = sweep_one(kind, layer, m, weights, bf16_ring, copy_bw, quick)
                if best is not None:
                    tuned[(kind, n, k, m)] = tuple(best)
            del weights, bf16_ring
            torch.cuda.empty_cache()
    print("\nTUNED_CONFIGS = {")
    for key, cfg in tuned.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")
    SUMMARY["tuned"] = {repr(k): v for k, v in tuned.items()}
    return tuned


def large_candidates(kind: str, quick: bool) -> list[QuantGemvConfig]:
    unpacks = {"int8": (0, 1), "int4": (1, 2), "fp8": (0,)}[kind]
    bms, bns = ((64,), (64, 128)) if quick else ((64, 128), (64, 128))
    bks, warps, stages = (128,), ((4,) if quick else (4, 8)), (3,)
    return [
        QuantGemvConfig(bn, bk, w, st, u, bm)
        for bm in bms for bn in bns for bk in bks for w in warps for st in stages for u in unpacks
    ]  # fmt: skip


@section("large M")
def large_m(copy_bw: float, quick: bool) -> None:
    """bf16 cuBLAS vs the generic fused GEMM, dequantize + cuBLAS, quant_gemv (best config)
    and fp8 W8A8, weights cycling through a ring (no L2 hits)."""
    for layer, (n, k) in SHAPES.items():
        if quick and layer not in ("gate_up", "o"):
            continue  # (the full run: every shape)
        copies = max(2, math.ceil(RING_BYTES / (2 * n * k)))
        w16 = [(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16),) for _ in range(copies)]
        rings = {kind: ring(kind, n, k) for kind in METHODS}
        for m in (128, 256):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            t_bf16 = time_ring(partial(F.linear, x), w16)
            parts = [f"{layer:7} M={m:4}: bf16 {t_bf16 * 1e6:6.1f} us"]
            for kind, weights in rings.items():
                t_f = time_ring(partial(dequant_gemm, kind, x), weights)
                t_d = time_ring(partial(dequant_cublas_gemm, kind, x), weights)
                part = f"{kind} generic {t_f * 1e6:6.1f} deq+cuBLAS {t_d * 1e6:6.1f}"
                if m <= quant_gemv.MAX_ROWS:
                    gemv = partial(quant_gemv.quant_gemv, kind, x)
                    cfgs = large_candidates(kind, quick)
                    qw0, s0, o0 = weights[0]
                    precompile([partial(gemv, qw0, s0, o0, config=c, warmup=True) for c in cfgs])
                    res = []
                    for cfg in cfgs:
                        try:
                            res.append((time_ring(partial(gemv_with, gemv, cfg), weights), cfg))
                        except Exception as e:  # noqa: BLE001
                            print(f"  {kind} M={m} {tuple(cfg)}: {type(e).__name__}: {e}")
                    if res:
                        t_g, best = min(res)
                        err = rel_err(
                            gemv(qw0, s0, o0, config=best), exact_ref(kind, x, qw0, s0, o0)
                        )
                        part += f" gemv {t_g * 1e6:6.1f} {tuple(best)} err {err:.1e}"
                parts.append(part)
            t_w8a8 = time_ring(partial(_scaled_mm, x), [(q, s, None) for q, s, _ in rings["fp8"]])
            t_q = time_cuda(partial(quantize_fp8_per_token, x), 3, 10)
            parts.append(f"w8a8 {t_w8a8 * 1e6:6.1f} (act quant {t_q * 1e6:.1f})")
            print("\n    ".join(parts), flush=True)
            SUMMARY[f"large_{layer}_{m}"] = parts
        del w16, rings
        torch.cuda.empty_cache()


def weight_bytes(llm: LLM) -> int:
    """Bytes batch-1 decode reads for weights: every linear (quantized + scales), the 16-bit LM
    head (the tied embedding when there is no head), the norms."""
    model = llm.llm_engine.runner.model
    total = sum(m.method.weight_bytes(m) for m in model.modules() if isinstance(m, MergedLinear))
    if model.lm_head is None:
        total += nbytes(model.embed_tokens.weight)
    total += sum(nbytes(p) for n, p in model.named_parameters() if n.endswith("norm.weight"))
    return total


@section("decode per method")
def decode(
    ceil, methods: list[str], batch_sizes: list[int], output_len: int, profiled: tuple = ()
) -> None:
    for method in methods:
        llm = None
        try:
            quant, _, variant = method.partition("/")
            common.USE_QUANT_GEMV = variant != "generic"
            common.USE_INT4_GEMV = variant != "old"  # int4/old: quant_gemv, no repack
            common.USE_INT8_GEMV = variant != "old"  # int8/old: quant_gemv, no planes
            common.GEMV_MAX_ROWS = 256 if variant == "gemv256" else common.DECODE_MAX_ROWS
            fused_decode.set_enabled(variant != "unfused")  # x/unfused: norms, adds apart
            t0 = time.perf_counter()
            llm = LLM(
                "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=1024,
                max_num_seqs=max(batch_sizes), kv_cache_memory_bytes=8 << 30,
                quantization=None if quant == "bf16" else quant,
            )  # fmt: skip
            torch.cuda.synchronize()
            startup = time.perf_counter() - t0
            wbytes = weight_bytes(llm)
            roof_tok_s = ceil.bandwidth_bytes_per_s / wbytes
            rows = latency.run(llm.llm_engine, ceil, batch_sizes, 128, output_len)
            print(latency.format_rows(rows), flush=True)
            tok_s = rows[0].output_tok_s
            steps = {r.batch_size: r.step_ms_p50 for r in rows}
            SUMMARY[f"decode_{method}"] = {
                "startup_s": startup, "weight_bytes": wbytes, "bs1_tok_s": tok_s,
                "roofline_tok_s": roof_tok_s, "step_ms": steps,
            }  # fmt: skip
            TABLE.append(
                f"{method:12} start-up {startup:5.1f} s, weights {wbytes / 2**30:5.2f} GiB, bs1 "
                f"{tok_s:6.1f} tok/s = {100 * tok_s / roof_tok_s:3.0f}% of {roof_tok_s:5.0f}; "
                "step ms " + "/".join(f"b{b} {steps[b]:.2f}" for b in batch_sizes)
            )
            print(TABLE[-1], flush=True)
            if method in profiled:
                SUMMARY[f"profile_{method}"] = quant_decode_bench.profile_engine(
                    llm.llm_engine, method
                )
        except Exception as e:  # noqa: BLE001
            print(f"decode {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            common.USE_QUANT_GEMV, common.GEMV_MAX_ROWS = True, common.DECODE_MAX_ROWS
            common.USE_INT4_GEMV, common.USE_INT8_GEMV = True, True
            fused_decode.set_enabled(True)
            llm = None
            gc.collect()
            torch.cuda.empty_cache()


@section("offline throughput")
def offline(ceil, num_requests: int) -> None:
    for method in ("bf16", "fp8-w8a8"):
        llm = LLM(
            "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=4096,
            max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
            quantization=None if method == "bf16" else method,
        )  # fmt: skip
        vocab = llm.llm_engine.model_config.vocab_size
        wl = workloads.synthetic(num_requests, (100, 1024), (512, 512), vocab)
        res = throughput.run(llm, ceil, wl, use_tqdm=False)
        SUMMARY[f"throughput_{method}"] = res.output_tok_s
        TABLE.append(
            f"throughput {method:9} {res.output_tok_s:6.0f} out tok/s ({num_requests} requests, "
            f"{res.elapsed_s:.1f} s, max running {res.max_running})"
        )
        print(TABLE[-1], flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if "throughput_bf16" in SUMMARY and "throughput_fp8-w8a8" in SUMMARY:
        ratio = SUMMARY["throughput_fp8-w8a8"] / SUMMARY["throughput_bf16"]
        TABLE.append(f"fp8 W8A8 / bf16 offline throughput: {ratio:.2f}x")


@section("logits error")
def logits_error() -> None:
    from roofline.bench import peers

    llm = LLM(
        "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=512,
        kv_cache_memory_bytes=1 << 30, enforce_eager=True,
    )  # fmt: skip
    hf = peers.hf_model_from_engine(llm.llm_engine)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    ids = torch.arange(1000, 1128, device=DEVICE)[None]
    linears = {
        n: m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    }
    originals = {n: m.weight.detach().clone().cpu() for n, m in linears.items()}
    with torch.inference_mode():
        base = hf(ids).logits.float()[0]  # [128, vocab]
    for method in METHODS:
        with torch.no_grad():
            for n, m in linears.items():
                w = originals[n].cuda()
                if method == "int8":
                    q = formats.quantize_int8(w, w.shape[1], torch.bfloat16)
                    deq = formats.dequantize_int8(q.qweight, q.scales, torch.bfloat16)
                elif method == "int4":
                    q4 = formats.quantize_int4(w, 128, True, torch.bfloat16)
                    deq = formats.dequantize_int4(*q4, torch.bfloat16)
                else:
                    q8, s = formats.quantize_fp8(w)
                    deq = formats.dequantize_fp8(q8, s, torch.bfloat16)
                m.weight.copy_(deq)
        with torch.inference_mode():
            got = hf(ids).logits.float()[0]
        rel = (got - base).abs() / base.abs().amax(dim=-1, keepdim=True)
        SUMMARY[f"logits_err_{method}"] = (rel.max().item(), rel.mean().item())
        TABLE.append(
            f"logits vs bf16, {method:5}: max rel {rel.max().item():.3e}, "
            f"mean rel {rel.mean().item():.3e}, top-1 agreement "
            f"{(got.argmax(-1) == base.argmax(-1)).float().mean().item():.3f}"
        )
        print(TABLE[-1], flush=True)
    del hf


@section("int4_gemv parity")
def int4_parity() -> None:
    worst = quant_decode_bench.parity()
    SUMMARY["int4_gemv_parity_worst"] = worst
    TABLE.append(f"int4_gemv parity: worst max-rel error {worst:.2e} (bound 1e-2)")


@section("decode GEMV per shape")
def shape_section(copy_bw: float, sweep: bool, out_dir: str) -> None:
    focus = quant_decode_bench.FOCUS
    sweep_ms = ((1,) if focus else (1, 4, 16)) if sweep else ()
    tuned, rows = quant_decode_bench.shape_table(copy_bw, (1,) if focus else (1, 4, 16), sweep_ms)
    SUMMARY["int4_gemv_tuned"] = {repr(k): v for k, v in tuned.items()}
    SUMMARY["decode_gemv_table"] = rows
    TABLE.extend(rows)
    if tuned:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "int4_gemv_tuned.txt"), "w") as f:
            f.write("".join(f"    {k!r}: {v!r},\n" for k, v in tuned.items()))
    # the decode runs below: the SiLU-fused down projection where the table measured it
    # faster than silu_and_mul + the GEMV
    down = [r for r in rows if r.startswith("down    M= 1")]
    for bits in (4, 8):
        if down and f"int{bits} silu fused" in down[0]:
            fused_us = float(down[0].split(f"int{bits} silu fused")[1].split("us")[0])
            split_us = float(down[0].split(f"int{bits} silu+gemv")[1].split("us")[0])
            common.GEMV_FUSE_SILU[bits] = fused_us < split_us
            print(f"int{bits} down at one row: SiLU fused {fused_us} us, apart {split_us} us")


def quick(ceil, args) -> None:
    """The decode check: int4_gemv parity, the per-shape table (with --sweep: int4_gemv's
    config sweep first, its winners installed), 8B batch 1 for bf16 / int8 / int4."""
    t0 = time.perf_counter()
    bw = ceil.bandwidth_bytes_per_s
    int4_parity()
    shape_section(bw, args.sweep, args.out)
    methods = ["int8", "int8/unfused", "int4", "int4/unfused"]
    if not args.focus:
        methods.insert(0, "bf16")
    decode(ceil, methods, [1], 32, profiled=("int4",))
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s)")
    print("\n".join(TABLE))
    with open(os.path.join(args.out, "gpu_quant.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true",
        help="about 90 s: int4_gemv parity, per-shape GEMV table at M = 1/4/16, 8B batch 1",
    )  # fmt: skip
    ap.add_argument(
        "--sweep", action="store_true",
        help="with --quick: sweep int4_gemv configs (M = 1, 4, 16), install the winners",
    )  # fmt: skip
    ap.add_argument(
        "--focus", action="store_true",
        help="with --quick --sweep: one row only, a few configs near the installed ones; no bf16",
    )  # fmt: skip
    ap.add_argument("--extra", action="store_true", help="also logits error and offline W8A8")
    ap.add_argument(
        "--requests", type=int, default=96, help="offline throughput requests (256: full workload)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    bw = ceil.bandwidth_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy_bw"] = bw
    if args.quick:
        quant_decode_bench.FOCUS = args.focus
        quick(ceil, args)
        return
    parity(True)
    tuned = sweep(bw, args.quick) or {}
    quant_gemv.TUNED_CONFIGS.update(tuned)  # the decode runs below use the measured configs
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_gemv_tuned.txt"), "w") as f:
        f.write("".join(f"    {k!r}: {v!r},\n" for k, v in tuned.items()))
    if args.quick:
        decode(ceil, ["int4", "int8"], [1], 32)
    else:
        decode(ceil, ["bf16", "int8", "int4", "fp8"], [1, 128], 32)
        decode(ceil, ["fp8-w8a8"], [128], 32)
    large_m(bw, args.quick)
    if args.extra:
        logits_error()
        offline(ceil, args.requests)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s)")
    print("\n".join(TABLE))
    with open(os.path.join(args.out, "gpu_quant.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
