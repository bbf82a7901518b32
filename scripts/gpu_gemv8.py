"""Batch-1 decode of the quantized methods on an H100 (Llama-3.1-8B config, random weights):
``kernels.int4_gemv`` for int4 g128, int8 and fp8 e4m3, and where a decode layer's time goes.

1. parity on the GPU: every layout (repacked int4, int8 nibble planes, per-channel int8 read as
   it is "i8", fp8, canonical int4; without ``--quick`` group-128 int8 bytes) against x
   times the exactly dequantized weight at one and 16 rows, the norm / SiLU prologues, the
   residual epilogue and the SiLU epilogue (bit-exact against ``silu_and_mul``);
2. i8 against the nibble planes and fp8 at the same bytes, per 8B shape at one row, plain and in
   the fused decode layer's variants (norm prologue, SiLU epilogue, residual); i8's configs
   swept (two tiles preloaded among them) and installed (``scripts/gemv8_int8.py``);
3. the one-copy layouts (i8; canonical int4 "c4", x permuted per tile) swept at 4 / 8 / 16 rows
   against the two-copy layouts they replace, and c4 at one row in the decode layer's call
   (``scripts/gemv8_batch.py``; winners installed);
4. (not ``--quick``) the canonical int4 bytes vs the repacked copy with the halves-moving path of
   before, and the fused decode MLP at one row, 8 layers in a CUDA graph per format: the SiLU in
   the gate | up GEMV's epilogue vs its own launch vs the down projection's prologue;
5. 8B batch-1 decode per method (the int8 and int4 layouts also at ``--batches``; ``/planes``:
   int8 on the repacked nibble planes, a second copy; ``/canon``: int4 on its canonical bytes,
   one copy; ``/pairs``: int4's (scale, offset) pairs, a copy, instead of its scales alone;
   ``/pf64k``: 64 KB of weight prefetched per program before the PDL wait;
   ``/fusedattn``: the fused decode attention at every shape), each beside its roofline (weight
   bytes + KV over the copy bandwidth of this run), the weights' GiB read and resident, and a
   kernel profile with each kernel's exclusive time (its part of the step not overlapped by the
   kernel before it).

``--full-sweep`` adds the one-row config sweep of every format (with ``preload``: the first tile
in registers before the PDL wait), int4_gemv's row tiles against ``mixed_gemm`` at 32-256 rows
and the attention-layer chain. Each section prints its error and goes on; the summary table
comes last.

    python scripts/gpu_gemv8.py --quick --batches 8,32    # about 2.5 minutes
    python scripts/gpu_gemv8.py                  # about 3 minutes
    python scripts/gpu_gemv8.py --full-sweep     # about 4 minutes
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
import traceback
from functools import partial

import gemv8_batch  # scripts/ is on sys.path when run as a script
import gemv8_int8
import gemv8_sweeps
import gpu_quant
import quant_decode_bench as qdb
import torch
import triton
from gemv8_common import (
    DEVICE,
    FORMATS,
    SHAPES,
    SUMMARY,
    TABLE,
    C,
    bits_of,
    fmt_key,
    group_of,
    make_weight,
    ring_of,
    section,
    sweep_configs,
)  # fmt: skip

from roofline import LLM
from roofline.bench import latency
from roofline.bench.ceilings import measure
from roofline.kernels import decode_attention
from roofline.kernels import decode_attention_fused as attn_fused
from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul, silu_and_mul_ref
from roofline.kernels.rmsnorm import rms_norm
from roofline.layers import fused_decode
from roofline.quantization import common


@section("parity")
def parity(formats: tuple[str, ...]) -> None:
    """Every layout against x times the exactly dequantized weight (picked configs, one and 16
    rows), the prologues and epilogues against the unfused kernels; compiles first, in parallel."""
    cases = []  # (fmt, layer, label, fn(warmup) -> out, ref thunk)
    for fmt in formats:
        for layer, (n, k) in SHAPES.items():
            words, pairs, _, deq = make_weight(fmt, n, k, seed=3)
            b = bits_of(fmt)
            run = partial(ig.int4_gemv, words=words, scale_pairs=pairs, bits=b)
            for m in (1, 16):
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                ref = (x.float() @ deq.T).to(x.dtype)
                cfg = ig.pick_config(n, k, group_of(fmt, k), m, x.device, fmt_key(fmt))
                cfg = cfg or ig.heuristic_config(n, k, group_of(fmt, k), m, 132)  # (quant_gemv's)
                cases.append((fmt, layer, f"M={m}", partial(run, x, config=cfg), ref))
            if fmt in ("fp8", "i8") and layer == "o":
                x = torch.randn(3, k, device=DEVICE, dtype=torch.float16)
                cases.append((fmt, layer, "fp16", partial(run, x), (x.float() @ deq.T).half()))
            if layer == "down":
                gu = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
                ref = (silu_and_mul_ref(gu).float() @ deq.T).to(gu.dtype)
                cases.append((fmt, layer, "silu", partial(run, gu, silu_mul=True), ref))
            elif layer in ("qkv", "gate_up"):
                h = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
                nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
                ref = (rms_norm(h, nw, 1e-5).float() @ deq.T).to(h.dtype)
                cases.append((fmt, layer, "norm", partial(run, h, norm=(nw, 1e-5)), ref))
                if layer == "gate_up":  # the SiLU epilogue vs silu_and_mul of the same GEMV
                    plain = partial(run, h, norm=(nw, 1e-5))
                    act = partial(run, h, norm=(nw, 1e-5), silu_out=True)
                    cases.append((fmt, layer, "silu_out", act, plain))
            else:
                x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
                res = torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16)
                ref = ((x.float() @ deq.T).to(x.dtype).float() + res.float()).to(x.dtype)
                cases.append((fmt, layer, "residual", partial(run, x, residual=res), ref))
    qdb.precompile([partial(fn, warmup=True) for *_, fn, _ in cases])
    worst = 0.0
    lines: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for fmt, layer, label, fn, ref in cases:
        if callable(ref):  # silu_out: silu_and_mul's bits of the plain GEMV's output
            got, plain = fn(), silu_and_mul(ref())
            err = qdb.rel_err(got, plain)
            SUMMARY[f"silu_out_exact_{fmt}"] = torch.equal(got, plain)
        else:
            err = qdb.rel_err(fn(), ref)
        worst = max(worst, err)
        lines[(fmt, layer)].append(f"{label} {err:.1e}")
    for (fmt, layer), errs in lines.items():
        print(f"{fmt:4} {layer:7}: max rel err " + ", ".join(errs))
    exact = {f: SUMMARY.get(f"silu_out_exact_{f}") for f in formats}
    print(f"SiLU epilogue bit-exact vs silu_and_mul: {exact}")
    SUMMARY["parity_worst"] = worst
    TABLE.append(
        f"parity int4/int8/fp8/canonical int4_gemv: worst max-rel error {worst:.2e} (bound 1e-2); "
        f"SiLU epilogue exact {exact}"
    )


@section("canonical vs repacked")
def canon_sweep(copy_bw: float) -> None:
    """int4 g128 read from its canonical bytes (no repacked copy: the words widened as repacked
    ones are, x permuted per tile) vs the repacked copy, per 8B shape: one row (the repacked
    table's config and a few around it; the fused decode layer's call, norm prologue / SiLU
    epilogue / residual, at the picked configs, and the halves-interleaving canonical path of
    before) and 4 / 8 / 16 rows. Canonical winners go to the "c4" table for the decode runs."""
    tuned: dict = {}
    for fmt, rep in (("c4", "int4"),):
        for layer, (n, k) in SHAPES.items():
            ring, _, deq = ring_of(fmt, n, k)
            ring_rep, _, _ = ring_of(rep, n, k)
            qbytes = qdb.nbytes(*ring[0])
            group = group_of(fmt, k)
            x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            base = ig.pick_config(n, k, group, 1, x.device, fmt_key(rep))
            around = [base, base._replace(preload=0), base._replace(num_stages=3),
                      base._replace(num_warps=8), C(64, 8, 1, 4, 3, 1, 1), C(128, 8, 1, 4, 2, 2, 1),
                      C(64, 8, 2, 4, 3), C(128, 4, 1, 4, 3, 4, 1), C(128, 8, 2, 4, 2),
                      C(128, 8, 1, 4, 2, 1, 1)]  # fmt: skip
            ref = (x.float() @ deq.T).to(x.dtype)
            good = sweep_configs(fmt, x, ring, ref, around)
            if good:
                ig.TUNED_CONFIGS[(fmt_key(fmt), n, k, group, 1)] = tuple(good[0][1])
            label, kw, xin, _ = gemv8_int8.decode_call(layer, k, n)
            xms = {m: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for m in (4, 8, 16)}
            warm = [partial(ig.int4_gemv, xin, *r[0], bits=4, **kw) for r in (ring, ring_rep)]
            warm += [partial(ig.int4_gemv, xm, *r[0], bits=4) for xm in xms.values()
                     for r in (ring, ring_rep)]  # fmt: skip
            qdb.precompile([partial(fn, warmup=True) for fn in warm])
            t_rep = qdb.time_ring(
                partial(ig.int4_gemv, x, bits=bits_of(fmt), config=base), ring_rep
            )
            parts = [f"repacked {t_rep * 1e6:.1f} us {100 * qbytes / t_rep / copy_bw:.0f}%"]
            if good:
                t, cfg = good[0]
                tuned[(fmt_key(fmt), n, k, group, 1)] = tuple(cfg)
                ig.TUNED_CONFIGS[(fmt_key(fmt), n, k, group, 1)] = tuple(cfg)
                parts.append(f"canonical {t * 1e6:.1f} us {100 * qbytes / t / copy_bw:.0f}% "
                             f"{tuple(cfg)}")  # fmt: skip
                ig.CANON4_XPERM = False
                try:
                    t_old = qdb.time_ring(partial(ig.int4_gemv, x, bits=4, config=cfg), ring)
                    parts.append(f"halves moved {t_old * 1e6:.1f}")
                finally:
                    ig.CANON4_XPERM = True
            t_c = qdb.time_ring(partial(ig.int4_gemv, xin, bits=4, **kw), ring)
            t_r = qdb.time_ring(partial(ig.int4_gemv, xin, bits=4, **kw), ring_rep)
            parts.append(f"{label} canonical {t_c * 1e6:.1f} / repacked {t_r * 1e6:.1f}")
            SUMMARY[f"c4_{layer}"] = {"m1": (t_rep, good[0][0] if good else None),
                                      label: (t_c, t_r)}  # fmt: skip
            for m, xm in xms.items():
                t_c = qdb.time_ring(partial(ig.int4_gemv, xm, bits=bits_of(fmt)), ring)
                t_r = qdb.time_ring(partial(ig.int4_gemv, xm, bits=bits_of(fmt)), ring_rep)
                parts.append(f"M={m} canonical {t_c * 1e6:.1f} / repacked {t_r * 1e6:.1f}")
            line = f"{fmt} {layer:7} M=1: " + " | ".join(parts)
            print(line, flush=True)
            TABLE.append(line)
            del ring, ring_rep
            torch.cuda.empty_cache()
    print("\nint4_gemv.TUNED_CONFIGS canonical (measured here) = {")
    for key, cfg in tuned.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")
    SUMMARY["tuned_canonical"] = {repr(k): v for k, v in tuned.items()}


def _mlp(variant: str, bits: int, h, norm, gate_up: tuple, down: tuple) -> torch.Tensor:
    """One fused decode MLP: the SiLU in the gate | up epilogue, apart, or in the down prologue."""
    if variant == "epilogue":
        act = ig.int4_gemv(h, *gate_up, norm=norm, silu_out=True, bits=bits)
        return ig.int4_gemv(act, *down, residual=h, bits=bits)
    gu = ig.int4_gemv(h, *gate_up, norm=norm, bits=bits)
    if variant == "apart":
        return ig.int4_gemv(silu_and_mul(gu), *down, residual=h, bits=bits)
    return ig.int4_gemv(gu, *down, silu_mul=True, residual=h, bits=bits)


@section("MLP at one row")
def mlp_chain(copy_bw: float) -> None:
    """8 layers of the fused decode MLP (norm + gate | up, then down + residual) in one CUDA
    graph per format: the SiLU in the gate | up epilogue, as its own launch, or as the down
    projection's prologue."""
    n, k = SHAPES["gate_up"]
    layers = 8
    for fmt in ("int4", "int8", "i8", "fp8"):
        b = bits_of(fmt)
        gus = [make_weight(fmt, n, k, seed=i)[:2] for i in range(layers)]
        downs = [make_weight(fmt, k, n // 2, seed=100 + i)[:2] for i in range(layers)]
        h = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        norm = (nw, 1e-5)

        times = {}
        for name in ("epilogue", "apart", "prologue"):
            calls = [partial(_mlp, name, b, h, norm, gus[i], downs[i]) for i in range(layers)]
            times[name] = qdb.time_graph(calls) * 1e6
        weights = qdb.nbytes(*gus[0], *downs[0])
        line = f"MLP {fmt}: " + ", ".join(
            f"SiLU {name} {t:.1f} us/layer ({100 * weights / (t * 1e-6) / copy_bw:.0f}%)"
            for name, t in times.items()
        )
        print(line, flush=True)
        TABLE.append(line)
        SUMMARY[f"mlp_{fmt}"] = times
        del gus, downs
        torch.cuda.empty_cache()


def _attn_layer(variant: str, qkv_fn, dims: tuple, rope: tuple, cache: tuple, ctx: int):
    """One attention layer's kernels after its qkv GEMV: none, rotary_kv_store + decode_attention
    (+ merge), or the fused decode attention."""
    from roofline.kernels.decode_attention import decode_attention
    from roofline.kernels.decode_attention_fused import fused_decode_attention
    from roofline.kernels.kv_store import rotary_kv_store

    heads, kv_heads, hd = dims
    out = qkv_fn()
    q = out[:, : heads * hd].view(1, heads, hd)
    k = out[:, heads * hd : (heads + kv_heads) * hd].view(1, kv_heads, hd)
    v = out[:, (heads + kv_heads) * hd :].view(1, kv_heads, hd)
    pos, cos_sin, qk_norm = rope
    kc, vc, slot, table, seq = cache
    if variant == "unfused":
        rotary_kv_store(q, k, v, pos, cos_sin, kc, vc, slot, qk_norm=qk_norm)
        decode_attention(q, kc, vc, table, seq, 0.088, max_seq_len=ctx)
    elif variant == "fused":
        fused_decode_attention(q, k, v, pos, cos_sin, qk_norm, kc, vc, slot, table, seq, 0.088, ctx)


@section("attention-layer kernels at one row")
def attention_chain() -> None:
    """32 layers of [qkv GEMV (+ the attention kernels)] in one CUDA graph (PDL as the engine
    runs it): the marginal microseconds of rotary_kv_store + decode_attention + merge vs the fused
    decode attention, for Llama-3.1-8B (32 / 8 heads, the int4 norm-fused qkv GEMV) and a
    Qwen3-0.6B-shaped layer (16 / 8 heads, q/k norm, its bf16 qkv GEMV), at 160 and 1000 tokens."""
    from roofline.kernels.gemv import skinny_gemm

    layers, page_size = 32, 16
    for model, dims, qk in (("8B", (32, 8, 128), False), ("0.6B", (16, 8, 128), True)):
        heads, kv_heads, hd = dims
        n = (heads + 2 * kv_heads) * hd
        k = 4096 if model == "8B" else 1024
        h = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        if model == "8B":
            ws = [make_weight("int4", n, k, seed=i)[:2] for i in range(layers)]
            fns = [partial(ig.int4_gemv, h, *w, norm=(nw, 1e-5)) for w in ws]
        else:
            ws = [
                torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(layers)
            ]
            fns = [partial(skinny_gemm, h, w, norm=(nw, 1e-5)) for w in ws]
        norm_w = torch.rand(hd, device=DEVICE, dtype=torch.bfloat16) + 0.5
        qk_norm = (norm_w, norm_w, 1e-6) if qk else None
        cos_sin = torch.randn(4096, hd, device=DEVICE, dtype=torch.bfloat16)
        parts = []
        for ctx in (160, 1000):
            pages = triton.cdiv(ctx, page_size) + 1
            kc = torch.randn(pages, page_size, kv_heads, hd, device=DEVICE, dtype=torch.bfloat16)
            cache = (kc, torch.randn_like(kc), torch.tensor([ctx - 1], device=DEVICE),
                     torch.arange(pages, device=DEVICE, dtype=torch.int32)[None],
                     torch.tensor([ctx], device=DEVICE, dtype=torch.int32))  # fmt: skip
            rope = (torch.tensor([ctx - 1], device=DEVICE), cos_sin, qk_norm)
            t = {}
            for variant in ("gemv", "unfused", "unfused_nopdl", "fused"):
                decode_attention.PDL_ATTENTION = variant != "unfused_nopdl"
                kind = "unfused" if variant == "unfused_nopdl" else variant
                calls = [partial(_attn_layer, kind, f, dims, rope, cache, ctx) for f in fns]
                t[variant] = qdb.time_graph(calls) * 1e6
            decode_attention.PDL_ATTENTION = True
            parts.append(f"ctx {ctx}: rotary+attention+merge +{t['unfused'] - t['gemv']:.2f} "
                         f"(split/merge without PDL +{t['unfused_nopdl'] - t['gemv']:.2f}), "
                         f"fused +{t['fused'] - t['gemv']:.2f} us/layer")  # fmt: skip
            SUMMARY[f"attention_{model}_{ctx}"] = t
        line = f"attention {model} ({heads}/{kv_heads} heads, PDL): " + "; ".join(parts)
        print(line, flush=True)
        TABLE.append(line)
        del ws, fns
        torch.cuda.empty_cache()


def resident_bytes(model: torch.nn.Module) -> int:
    """CUDA bytes held by the model's tensors: parameters, buffers and tensor attributes (the
    kernels' repacked copies), each storage counted once."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        tensors = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        tensors += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.is_cuda:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def exclusive_profile(engine, label: str, steps: int = 20) -> None:
    """Kernel time per batch-1 decode step by name: the profiler's duration and the exclusive
    part (end - max(start, the latest end before it)): what each kernel adds to the step."""
    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10 + 3 * steps, ignore_eos=True)
    engine.add_request(f"profile-{label}", [(7 * j) % 1000 + 10 for j in range(128)], params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    dur: dict[str, float] = collections.defaultdict(float)
    excl: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    last_end = -1e30
    for e in events:
        name = e.name.split("(")[0][:60]
        start, end = e.time_range.start, e.time_range.end
        dur[name] += end - start
        excl[name] += max(0.0, end - max(start, last_end))
        count[name] += 1
        last_end = max(last_end, end)
    busy = sum(excl.values()) / steps
    lines = [
        f"profile {label} batch 1: wall {wall_us:.0f} us/step, busy (union of kernels) "
        f"{busy:.0f} us/step"
    ]
    for name in sorted(excl, key=lambda n: -excl[n])[:10]:
        lines.append(
            f"  {excl[name] / steps:7.1f} us/step exclusive, {dur[name] / steps:7.1f} duration, "
            f"{count[name] / steps:4.0f}x  {name}"
        )
    print("\n".join(lines), flush=True)
    SUMMARY[f"profile_{label}"] = lines


@section("decode per method")
def decode(
    ceil, methods: list[str], profiled: tuple[str, ...], extra_batches: tuple[int, ...] = (8,)
) -> None:
    for method in methods:
        quant, _, variant = method.partition("/")
        more = quant in ("int8", "int4") and variant in ("", "planes", "canon")
        batches = [1, *extra_batches] if more else [1]
        llm = None
        fused_shapes = set(attn_fused.UNFUSED_FASTER)
        try:
            common.USE_FP8_GEMV = variant != "old"
            common.INT4_GEMV_CANONICAL = variant == "canon"
            common.INT4_GEMV_PAIRS = variant == "pairs"
            common.INT8_GEMV_PLANES = variant == "planes"
            fused_decode.SILU_EPILOGUE = variant != "nosiluepi"
            ig.PREFETCH_BYTES = 65536 if variant == "pf64k" else 16384
            if variant == "fusedattn":  # every shape on the fused decode attention
                attn_fused.UNFUSED_FASTER.clear()
            t0 = time.perf_counter()
            llm = LLM(
                "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=1024,
                max_num_seqs=max(batches), kv_cache_memory_bytes=8 << 30,
                quantization=None if quant == "bf16" else quant,
            )  # fmt: skip
            torch.cuda.synchronize()
            startup = time.perf_counter() - t0
            model = llm.llm_engine.runner.model
            wbytes = gpu_quant.weight_bytes(llm)
            resident = resident_bytes(model)
            rows = latency.run(llm.llm_engine, ceil, batches, 128, 64)
            print(latency.format_rows(rows), flush=True)
            r = rows[0]
            roof = 1e3 / r.roofline_step_ms  # weights + KV over this run's copy bandwidth
            SUMMARY[f"decode_{method}"] = {
                "startup_s": startup, "weight_bytes": wbytes, "resident_bytes": resident,
                "bs1_tok_s": r.output_tok_s, "step_ms": r.step_ms_p50, "roofline_tok_s": roof,
                "step_ms_by_batch": {x.batch_size: x.step_ms_p50 for x in rows},
            }  # fmt: skip
            TABLE.append(
                f"{method:10} bs1 {r.output_tok_s:6.1f} tok/s = {r.roofline_pct:4.1f}% of its "
                f"roofline ({roof:5.0f}); step {r.step_ms_p50:.3f} ms; weights {wbytes / 2**30:.2f}"
                f" GiB read, {resident / 2**30:.2f} GiB resident; start-up {startup:.1f} s"
                + "".join(f"; b{x.batch_size} {x.step_ms_p50:.2f} ms" for x in rows[1:])
            )
            print(TABLE[-1], flush=True)
            if method in profiled:
                exclusive_profile(llm.llm_engine, method)
        except Exception as e:  # noqa: BLE001
            print(f"decode {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            attn_fused.UNFUSED_FASTER.update(fused_shapes)
            common.INT4_GEMV_CANONICAL = False
            common.INT8_GEMV_PLANES = False
            common.INT4_GEMV_PAIRS = False
            common.USE_FP8_GEMV = True
            fused_decode.SILU_EPILOGUE = True
            ig.PREFETCH_BYTES = 16384
            fused_decode.set_enabled(True)
            llm = None
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--full-sweep", action="store_true",
        help="also the one-row config sweep of every format and the row-tile sweep (~70 s more)",
    )  # fmt: skip
    ap.add_argument(
        "--quick", action="store_true",
        help="parity (int4, int8 planes, i8, fp8, c4), i8 vs planes vs fp8, c4 vs int4, decode",
    )  # fmt: skip
    ap.add_argument(
        "--methods",
        default="bf16,int8,int8/pf64k,int4,int4/canon,int4/pairs,int4/pf64k,fp8,fp8/pf64k",
        help="decode runs; variants /planes (int8 repacked nibble planes) /fusedattn /canon "
        "/nosiluepi /old (fp8 on quant_gemv) /pf64k",
    )  # fmt: skip
    ap.add_argument("--profile", default="int8,int4/canon", help="decode runs to profile")
    ap.add_argument(
        "--batches", default="8", help="batch sizes beyond 1 for the int8 / int4 layouts' decode"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    bw = ceil.bandwidth_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy_bw"] = bw
    parity(FORMATS + ("int4p", "c4") if args.quick else FORMATS + ("int4p", "c4", "c8"))
    gemv8_int8.compare(bw)
    gemv8_batch.sweep(bw)
    if args.full_sweep:
        gemv8_sweeps.gemv_sweep(bw)
        gemv8_sweeps.row_tiles(bw)
        attention_chain()
    if not args.quick:
        canon_sweep(bw)
        mlp_chain(bw)
    extra = tuple(int(b) for b in args.batches.split(",") if b)
    decode(ceil, args.methods.split(","), tuple(args.profile.split(",")), extra)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s)")
    print("\n".join(TABLE))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_gemv8.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
