"""The chained-kernel measurements of ``scripts/gpu_gemv8.py`` (not ``--quick``), H100,
Llama-3.1-8B shapes: the fused decode MLP at one row (8 layers in a CUDA graph per format: the
SiLU in the gate | up GEMV's epilogue vs its own launch vs the down projection's prologue) and an
attention layer at one row (32 layers of qkv GEMV + rotary / store + attention with PDL, the
unfused kernels vs the fused decode attention, 8B and Qwen3-0.6B shapes)."""

from __future__ import annotations

from functools import partial

import quant_decode_bench as qdb  # scripts/ is on sys.path when run as a script
import torch
import triton
from gemv8_common import DEVICE, SHAPES, SUMMARY, TABLE, bits_of, make_weight, section

from roofline.kernels import decode_attention
from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul


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
