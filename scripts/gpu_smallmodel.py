"""Issue 13's small-model decode on one GPU: the fused decode attention (q/k norm, RoPE, K/V
store, attention and split merge in one launch) and the LM head + greedy argmax inside the
decode CUDA graphs, each on and off.

Sections (each in try/except; a summary table last):
  parity    fp32 greedy tokens = HF transformers on tiny Qwen3 / Llama / Qwen3-MoE configs with
            the new paths (two split sizes, so the in-kernel merge runs); the kernels against
            their torch references in bf16 and fp32
  attention the attention of one layer at batch 1 (Qwen3-0.6B shape) in a CUDA graph: the old
            three launches vs the fused kernel at several split sizes and contexts
  qwen3     Qwen3-0.6B batch-1 decode, tok/s, % of roofline, kernels per step, per mode
  llama     Llama-3.1-8B batch 1 and 32 (regression), modes off / on
  moe       Qwen3-30B-A3B batch 1 (needs ~61 GB; last), modes off / on

    python scripts/gpu_smallmodel.py --quick   # ~90 s: parity, attention, qwen3, llama bs1
    python scripts/gpu_smallmodel.py           # < 4 min: everything
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gpu_common import profiled_steps, sections  # scripts/ is on sys.path when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.hf_reference

from roofline.kernels import (  # noqa: E402
    decode_attention_fused,
    gemv_preload,
    pdl,
    stage_decode,
)
from roofline.layers import fused_decode  # noqa: E402
from roofline.worker import graph_head  # noqa: E402

DEV = torch.device("cuda")
SUMMARY: list[tuple[str, str]] = []
MODES = {  # name -> (fused decode attention, LM head + argmax in the graph, fused MoE layer,
    #           decode inputs staged in one launch, GEMV weights preloaded before the PDL wait)
    "off": (False, False, False, False, False),
    "attn": (True, False, False, False, False),
    "on": (True, True, True, True, False),
    "on+preload": (True, True, True, True, True),
}


section = sections(
    lambda name, e: SUMMARY.append((name, "FAILED")),
    footer="--- {name}: {seconds:.1f} s",
    free_cuda=True,
)


def set_mode(engine, mode: str) -> None:
    attn, head, moe, stage, preload = MODES[mode]
    gemv_preload.set_enabled(preload)
    decode_attention_fused.set_enabled(attn)
    graph_head.set_enabled(head)
    fused_decode.set_moe_enabled(moe)
    stage_decode.set_enabled(stage)
    if engine is not None:
        engine.runner.capture_cuda_graphs()  # the graphs hold the kernels of the mode


# ---------------------------------------------------------------- parity
@section("parity: fp32 greedy tokens vs HF (tiny configs, CUDA graphs, new paths)")
def parity_hf(archs: tuple[str, ...], split_sizes: list[int]) -> None:
    from roofline import LLM, SamplingParams
    from tests.e2e.hf_reference import hf_greedy, tiny_hf_model
    from tests.e2e.test_parity_tiny import NUM_NEW, _prompts

    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            hf = tiny_hf_model(arch, tmp, head_dim=32, hidden_size=128, num_attention_heads=4)
            prompts = _prompts(len(arch) * 7)
            expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
            for split_tokens in split_sizes:
                decode_attention_fused.set_split_tokens(split_tokens)
                set_mode(None, "on")
                llm = LLM(tmp, dtype="float32", device="cuda", max_model_len=256,
                          max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
                          cuda_graph_mode="full_decode_only")  # fmt: skip
                params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
                outs = llm.generate(prompts, params, use_tqdm=False)
                got = [o.outputs[0].token_ids for o in outs]
                same = sum(g == e for g, e in zip(got, expected))
                print(f"  {arch} split_tokens={split_tokens}: {same}/{len(prompts)} prompts "
                      f"identical to HF ({NUM_NEW} tokens each)", flush=True)  # fmt: skip
                SUMMARY.append((f"fp32 = HF {arch} split {split_tokens}", f"{same}/{len(prompts)}"))
                del llm
                gc.collect()
    decode_attention_fused.set_split_tokens(64)


@section("parity: fused kernels vs torch references on the GPU")
def parity_kernels() -> None:
    from roofline.kernels.decode_attention_fused import (
        fused_decode_attention,
        fused_decode_attention_ref,
    )
    from roofline.kernels.gemv import skinny_gemm
    from roofline.kernels.lm_head_argmax import lm_head_argmax

    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for ctx, splits in ((37, 1), (700, 8), (3000, 32)):
            nh, nkv, hd, ps = 16, 8, 128, 16
            pages = ctx // ps + 8
            kc = torch.randn(pages, ps, nkv, hd, device=DEV, generator=gen).to(dtype)
            vc = torch.randn(pages, ps, nkv, hd, device=DEV, generator=gen).to(dtype)
            bt = torch.randperm(pages, device=DEV, generator=gen).to(torch.int32)[None, :]
            seq = torch.tensor([ctx + 1], dtype=torch.int32, device=DEV)
            pos = seq.long() - 1
            slot = (bt[0, ctx // ps].long() * ps + ctx % ps).view(1)
            qkv = torch.randn(1, (nh + 2 * nkv) * hd, device=DEV, generator=gen).to(dtype)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(1, nh, hd), k.view(1, nkv, hd), v.view(1, nkv, hd)
            w = (1 + 0.3 * torch.randn(2, hd, device=DEV, generator=gen)).to(dtype)
            inv = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device=DEV).float() / hd)
            f = torch.arange(4096, device=DEV).float()[:, None] * inv[None, :]
            cs = torch.cat([f.cos(), f.sin()], dim=-1)
            kc2, vc2 = kc.clone(), vc.clone()
            ref = fused_decode_attention_ref(q, k, v, pos, cs, (w[0], w[1], 1e-6), kc2, vc2, slot,
                                             bt, seq, hd**-0.5)  # fmt: skip
            out = fused_decode_attention(q, k, v, pos, cs, (w[0], w[1], 1e-6), kc, vc, slot, bt,
                                         seq, hd**-0.5, ctx + 1, max_splits=splits)  # fmt: skip
            err = (out.float() - ref.float()).abs().max().item()
            kerr = (kc.float() - kc2.float()).abs().max().item()
            bound = 1e-4 if dtype == torch.float32 else 3e-2
            ok &= err < bound and kerr < bound
            print(f"  fused attention {dtype} ctx={ctx} splits<={splits}: max |out - ref| "
                  f"{err:.2e}, cache {kerr:.2e}")  # fmt: skip
    for m in (1, 2, 8):
        for n, kdim in ((151936, 1024), (128256, 4096)):
            x = torch.randn(m, kdim, device=DEV, generator=gen).to(torch.bfloat16)
            wt = (torch.randn(n, kdim, device=DEV, generator=gen) / kdim**0.5).to(torch.bfloat16)
            logits, ids = lm_head_argmax(x, wt)
            want = skinny_gemm(x, wt).float()
            same = torch.equal(logits, want) and torch.equal(ids, want.argmax(-1))
            ok &= same
            print(f"  lm_head_argmax M={m} {n}x{kdim}: logits and ids bit-equal {same}")
            del wt
    # the preloaded one-row GEMV vs the skinny GEMM (Qwen3-0.6B shapes; PDL launches)
    for n, kdim, kind in ((4096, 1024, "norm"), (1024, 3072, "silu"), (1024, 2048, "add")):
        w = (torch.randn(n, kdim, device=DEV, generator=gen) / kdim**0.5).to(torch.bfloat16)
        res = torch.randn(1, n, device=DEV, generator=gen).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(kdim, device=DEV, generator=gen)).to(torch.bfloat16)
        cols = 2 * kdim if kind == "silu" else kdim
        x = torch.randn(1, cols, device=DEV, generator=gen).to(torch.bfloat16)
        kw = {"norm": {"norm": (nw, 1e-6)}, "silu": {"silu_mul": True, "residual": res},
              "add": {"residual": res}}[kind]  # fmt: skip
        err = gemv_preload.gemv_preload(x, w, **kw).float() - skinny_gemm(x, w, **kw).float()
        err = err.abs().max().item()
        ok &= err < 3e-2
        print(f"  gemv_preload {n}x{kdim} {kind}: max |diff| vs skinny_gemm {err:.2e}")
    # the fused MoE layer (router kernel + expert GEMVs + add) vs the unfused block, 30B shapes
    from roofline.layers.moe import FusedMoE
    from roofline.layers.norm import RMSNorm

    torch.manual_seed(0)
    with torch.device(DEV):
        moe = FusedMoE(2048, 768, 128, 8, renormalize=True).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    norm = RMSNorm(2048, 1e-6).to(DEV, torch.bfloat16)
    worst = 0.0
    with torch.inference_mode():
        for _ in range(5):
            h = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)
            got = fused_decode.moe_norm_add(moe, norm, h)
            want = h + moe(norm(h))
            worst = max(worst, (got.float() - want.float()).abs().max().item())
    ok &= worst < 5e-2
    print(f"  fused MoE layer vs unfused (bf16, 30B shapes): max |diff| {worst:.2e}")
    SUMMARY.append(("kernel parity (GPU)", "ok" if ok else "MISMATCH"))


# ---------------------------------------------------------------- attention alone
def graph_us(fn, reps: int = 20) -> float:
    """Mean us per call of ``fn`` replayed in a CUDA graph of ``reps`` back-to-back calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (10 * reps) * 1e6


@section("attention of one layer, batch 1, Qwen3-0.6B shape, CUDA graph (us per layer)")
def attention_alone(contexts: list[int], split_sizes: list[int]) -> None:
    from roofline.kernels.decode_attention import decode_attention
    from roofline.kernels.decode_attention_fused import fused_decode_attention
    from roofline.kernels.kv_store import rotary_kv_store

    nh, nkv, hd, ps, layers, max_len = 16, 8, 128, 16, 8, 4096
    dt = torch.bfloat16
    pages = max_len // ps
    kc = torch.randn(layers, pages, ps, nkv, hd, device=DEV).to(dt)
    vc = torch.randn(layers, pages, ps, nkv, hd, device=DEV).to(dt)
    bt = torch.arange(pages, device=DEV, dtype=torch.int32)[None, :]
    qkv = torch.randn(1, (nh + 2 * nkv) * hd, device=DEV).to(dt)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.view(1, nh, hd), k.view(1, nkv, hd), v.view(1, nkv, hd)
    w = torch.ones(hd, device=DEV, dtype=dt)
    inv = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device=DEV).float() / hd)
    f = torch.arange(max_len, device=DEV).float()[:, None] * inv[None, :]
    cs = torch.cat([f.cos(), f.sin()], dim=-1)
    layer = iter(range(10**9))
    seq = torch.ones(1, dtype=torch.int32, device=DEV)
    pos = torch.zeros(1, dtype=torch.int64, device=DEV)

    def old():
        i = next(layer) % layers
        rotary_kv_store(q, k, v, pos, cs, kc[i], vc[i], pos, (w, w, 1e-6))
        decode_attention(q, kc[i], vc[i], bt, seq, hd**-0.5, max_seq_len=max_len)

    def new():
        i = next(layer) % layers
        fused_decode_attention(q, k, v, pos, cs, (w, w, 1e-6), kc[i], vc[i], pos, bt, seq,
                               hd**-0.5, max_len)  # fmt: skip

    for ctx in contexts:
        seq.fill_(ctx)
        pos.fill_(ctx - 1)  # also the slot: block table row 0 is the identity
        row = [f"3 launches {graph_us(old):6.2f}"]
        for tokens in split_sizes:
            decode_attention_fused.set_split_tokens(tokens)
            row.append(f"fused/{tokens} {graph_us(new):6.2f}")
        print(f"  ctx {ctx:>5}: " + " | ".join(row) + " us", flush=True)
        SUMMARY.append((f"attention bs1 ctx {ctx} (us)", ", ".join(r.split()[-1] for r in row)))
    decode_attention_fused.set_split_tokens(64)


def _head_row(n: int, k: int) -> str:
    from roofline.kernels.gemv import SkinnyConfig, pick_config, skinny_gemm
    from roofline.kernels.lm_head_argmax import lm_head_argmax

    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device=DEV).to(torch.bfloat16)
    row = [f"skinny_gemm {graph_us(lambda: skinny_gemm(x, w), reps=5):.1f}"]
    cands = [pick_config(1, n, k, DEV), SkinnyConfig(64, 512, 4, 3, True),
             SkinnyConfig(128, 512, 4, 2, True), SkinnyConfig(256, 256, 8, 3, True),
             SkinnyConfig(64, 256, 4, 4, True), SkinnyConfig(32, 512, 4, 4, False),
             SkinnyConfig(16, 1024, 4, 2, False)]  # fmt: skip
    for c in cands:
        us = graph_us(lambda c=c: lm_head_argmax(x, w, config=c), reps=5)
        row.append(f"{c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}/"
                   f"{'dot' if c.use_dot else 'fma'} {us:.1f}")  # fmt: skip
    return f"  {n}x{k} ({n * k * 2 / 1e6:.0f} MB, first = tuned): " + " | ".join(row)


@section("LM head + argmax configs, M = 1, CUDA graph (us per call)")
def head_configs(shapes: tuple[tuple[int, int], ...]) -> None:
    for n, k in shapes:
        print(_head_row(n, k), flush=True)


# ---------------------------------------------------------------- engine
def load(model: str, **kw):
    from roofline import LLM

    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", **kw)
    torch.cuda.synchronize()
    print(f"  {model}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def kernels_per_step(engine, steps: int = 10, top_n: int = 10) -> tuple[float, list[str]]:
    """(kernels per step, top kernels by time) over decode steps, torch.profiler."""
    prof = profiled_steps(engine, 3, steps)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    count = sum(len(v) for v in per_name.values()) / steps
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    lines = [f"{sum(t) / steps:8.1f} us/step {len(t) / steps:5.0f}x {sum(t) / len(t):6.1f} us  "
             f"{n[:80]}" for n, t in top]  # fmt: skip
    return count, lines


def decode_modes(llm, name: str, ceil, batches: list[int], modes: list[str], out_len: int,
                 profile: bool) -> None:  # fmt: skip
    from roofline import SamplingParams
    from roofline.bench import latency

    engine = llm.llm_engine
    for mode in modes:
        try:
            set_mode(engine, mode)
            rows = latency.run(engine, ceil, batches, 128, out_len)
            for r in rows:
                print(f"  {name} bs={r.batch_size} {mode:>9}: {r.step_ms_p50:.3f} ms/step, "
                      f"{r.output_tok_s:8.1f} tok/s, {r.roofline_pct:5.1f}% of roofline "
                      f"({r.roofline_step_ms:.3f} ms)", flush=True)  # fmt: skip
                SUMMARY.append((f"{name} bs{r.batch_size} {mode}",
                                f"{r.output_tok_s:.1f} tok/s ({r.roofline_pct:.1f}%)"))  # fmt: skip
            if profile:
                engine.add_request(f"prof-{mode}", list(range(10, 522)),
                                   SamplingParams(max_tokens=40, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
                engine.step()
                count, top = kernels_per_step(engine)
                while engine.has_unfinished_requests():
                    engine.step()
                print(f"  {name} bs=1 {mode}: {count:.0f} kernels/step (context ~520)")
                for line in top:
                    print("      " + line)
                SUMMARY.append((f"{name} bs1 {mode} kernels/step", f"{count:.0f}"))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY.append((f"{name} {mode}", "FAILED"))
    # greedy tokens of each mode against the one before (bf16: near-ties may flip with the
    # attention's summation order; the graph head and the staging must not change a token)
    try:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        outs = {}
        for mode in modes:
            set_mode(engine, mode)
            engine.kv_manager.reset_prefix_cache()
            res = llm.generate([list(range(20, 84))], params, use_tqdm=False)
            outs[mode] = res[0].outputs[0].token_ids
        for prev, mode in zip(modes, modes[1:]):  # "on" vs "attn": the head, same bits
            same = sum(a == b for a, b in zip(outs[mode], outs[prev]))
            print(f"  {name} {mode} vs {prev}: {same}/32 greedy tokens equal")
            SUMMARY.append((f"{name} tokens {mode} vs {prev}", f"{same}/32"))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    set_mode(engine, "on")


@section("Qwen3-0.6B batch-1 decode per mode")
def qwen3(ceil, out_len: int, sweep: bool) -> None:
    llm = load("qwen3-0.6b", max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.4)
    decode_modes(llm, "qwen3-0.6b", ceil, [1], list(MODES), out_len, profile=True)
    if sweep:  # the device split size, and real kernel durations without PDL overlap
        from roofline.bench import latency

        for tokens in (128, 256):
            decode_attention_fused.set_split_tokens(tokens)
            set_mode(llm.llm_engine, "on")
            r = latency.run(llm.llm_engine, ceil, [1], 128, out_len)[0]
            print(f"  split_tokens={tokens}: {r.output_tok_s:.1f} tok/s")
            SUMMARY.append((f"qwen3-0.6b bs1 split {tokens}", f"{r.output_tok_s:.1f} tok/s"))
        decode_attention_fused.set_split_tokens(64)
        pdl.set_pdl(False)
        set_mode(llm.llm_engine, "on")
        engine = _decoding(llm)
        count, top = kernels_per_step(engine, top_n=14)
        while engine.has_unfinished_requests():
            engine.step()
        print(f"  PDL off (true kernel durations): {count:.0f} kernels/step")
        for line in top:
            print("      " + line)
        pdl.set_pdl(True)
    del llm


def _decoding(llm):
    from roofline import SamplingParams

    engine = llm.llm_engine
    engine.add_request("prof-nopdl", list(range(10, 522)),
                       SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))  # fmt: skip
    engine.step()
    return engine


@section("Llama-3.1-8B decode, modes off / on")
def llama(ceil, out_len: int, batches: list[int]) -> None:
    llm = load("llama-3.1-8b", max_model_len=4096, max_num_seqs=max(batches),
               gpu_memory_utilization=0.6)  # fmt: skip
    decode_modes(llm, "llama-3.1-8b", ceil, batches, ["off", "on"], out_len, profile=False)
    del llm


@section("Qwen3-30B-A3B batch-1 decode, modes off / on")
def moe(ceil) -> None:
    free, total = torch.cuda.mem_get_info()
    print(f"  GPU memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    llm = load("qwen3-30b-a3b", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.92)
    decode_modes(llm, "qwen3-30b-a3b", ceil, [1], list(MODES), 64, profile=True)
    del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from roofline.bench.ceilings import measure

    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
          f"torch {torch.__version__}, PDL {pdl.pdl_enabled()}")  # fmt: skip
    quick = args.quick
    if quick:
        parity_hf(("qwen3", "llama"), [64])
    else:
        parity_hf(("qwen3", "llama", "qwen3_moe"), [64, 128])
    parity_kernels()
    attention_alone([512, 2048] if quick else [64, 256, 512, 1024, 2048, 4000],
                    [64, 128] if quick else [64, 128, 256])  # fmt: skip
    head_configs(((151936, 1024),) if quick else ((151936, 1024), (128256, 4096)))
    qwen3(ceil, 128 if quick else 256, sweep=not quick)
    llama(ceil, 64 if quick else 128, [1, 128] if quick else [1, 8, 32, 128])
    if not quick:
        moe(ceil)
    print(f"\n=== summary ({time.perf_counter() - t_start:.0f} s)")
    for name, value in SUMMARY:
        print(f"  {name:<44} {value}")


if __name__ == "__main__":
    main()
