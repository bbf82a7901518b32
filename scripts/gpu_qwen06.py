"""Qwen3-0.6B batch-1 decode (issue 13, small models): the preloaded one-row GEMV on by default,
what it does to batch invariance, and where a ~0.8 ms step still goes.

Sections (each in try/except; a summary table last):
  parity     fp32 greedy tokens = HF on a tiny Qwen3 with the preloaded GEMV (CUDA graphs)
  bits       kernel level, Qwen3-0.6B shapes, bf16: does a row get the same bits alone (M = 1)
             and among 2 or 8 rows? skinny GEMM M = 1 vs the preload; vs the
             batched rows (separate norm + tensor-core GEMM); tensor cores at M = 1 vs M = 2
  invariance engine level, Qwen3-0.6B bf16 random weights: 4 requests alone vs in batches of
             3 / 8 / 17 (greedy tokens through the graph head; sampled-token logprob bits),
             preload off and on
  qwen3      Qwen3-0.6B batch 1, preload off / on (median of 6 runs, 2 captures each), batch 8
             and 64; host work per step; the preload's (BLOCK_N, num_warps) in the engine;
             kernels per step with PDL and without (true durations)
  llama      Llama-3.1-8B batch 1 and 64, preload off / on (regression)
  moe        Qwen3-30B-A3B with 8 layers, batch 1, preload off / on (its attention GEMVs)

    python scripts/gpu_qwen06.py           # everything, ~3 min
    python scripts/gpu_qwen06.py --quick   # parity, invariance, qwen3 and 8B timings, ~90 s
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.hf_reference
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_smallmodel's helpers

import gpu_smallmodel as sm  # noqa: E402

from roofline.kernels import decode_attention_fused, gemv_preload, pdl  # noqa: E402

DEV = torch.device("cuda")
SUMMARY = sm.SUMMARY
section = sm.section
QWEN_SHAPES = (
    (4096, 1024, "norm"), (1024, 2048, "add"), (6144, 1024, "norm"), (1024, 3072, "silu")
)  # fmt: skip


def set_preload(engine, on: bool) -> None:
    sm.set_mode(engine, "on+preload" if on else "on")


# ---------------------------------------------------------------- parity
@section("parity: fp32 greedy tokens vs HF (tiny Qwen3, preloaded GEMV, CUDA graphs)")
def parity_hf() -> None:
    from roofline import LLM, SamplingParams
    from tests.e2e.hf_reference import hf_greedy, tiny_hf_model
    from tests.e2e.test_parity_tiny import NUM_NEW, _prompts

    for arch in ("qwen3",):  # Llama's layers take the same GEMVs, without the q/k norm
        with tempfile.TemporaryDirectory() as tmp:
            hf = tiny_hf_model(arch, tmp, head_dim=32, hidden_size=128, num_attention_heads=4)
            prompts = _prompts(len(arch) * 7)
            expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
            set_preload(None, True)
            llm = LLM(tmp, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8,
                      kv_cache_memory_bytes=64 << 20,
                      cuda_graph_mode="full_decode_only")  # fmt: skip
            params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            same = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected))
            print(f"  {arch}: {same}/{len(prompts)} prompts identical to HF ({NUM_NEW} tokens)")
            SUMMARY.append((f"fp32 = HF {arch} (preload)", f"{same}/{len(prompts)}"))
            del llm
            gc.collect()


# ---------------------------------------------------------------- kernel bits
def _inputs(n: int, k: int, kind: str, m: int, gen) -> tuple[torch.Tensor, dict]:
    bf = torch.bfloat16
    cols = 2 * k if kind == "silu" else k
    x = (torch.randn(m, cols, device=DEV, generator=gen) * (3 if kind == "norm" else 1)).to(bf)
    kw: dict = {}
    if kind == "norm":
        kw["norm"] = ((1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(bf), 1e-6)
    else:
        kw["residual"] = torch.randn(m, n, device=DEV, generator=gen).to(bf)
    if kind == "silu":
        kw["silu_mul"] = True
    return x, kw


def _rows(kw: dict, rows: slice) -> dict:
    out = dict(kw)
    if "residual" in out:
        out["residual"] = out["residual"][rows].contiguous()
    return out


@section("bits: one row alone vs among M rows (Qwen3-0.6B shapes, bf16; differing outputs)")
def kernel_bits() -> None:
    from roofline.kernels.gemv import pick_config, skinny_gemm
    from roofline.kernels.rmsnorm import rms_norm

    gen = torch.Generator(device=DEV).manual_seed(1)
    trials = 16
    for n, k, kind in QWEN_SHAPES:
        w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(torch.bfloat16)
        diff = {"preload": 0, "M=2": 0, "M=8": 0, "dot M=1 vs M=2": 0}
        total, worst = 0, 0.0
        bk2 = pick_config(2, n, k, DEV).block_k
        for _ in range(trials):
            x8, kw8 = _inputs(n, k, kind, 8, gen)
            x1, kw1 = x8[:1].contiguous(), _rows(kw8, slice(0, 1))
            one = skinny_gemm(x1, w, **kw1)
            pre = gemv_preload.gemv_preload(x1, w, **kw1)
            diff["preload"] += (one != pre).sum().item()
            worst = max(worst, (pre.float() - one.float()).abs().max().item())
            for m in (2, 8):
                xm, kwm = x8[:m].contiguous(), _rows(kw8, slice(0, m))
                if "norm" in kwm:  # batched rows take the separate norm, then the GEMM
                    xn = rms_norm(xm, *kwm.pop("norm"))
                    diff[f"M={m}"] += (skinny_gemm(xn, w, **kwm)[:1] != one).sum().item()
                else:
                    diff[f"M={m}"] += (skinny_gemm(xm, w, **kwm)[:1] != one).sum().item()
            if "norm" not in kw8:
                d1 = skinny_gemm(x1, w, use_dot=True, block_k=bk2, **kw1)
                for m in (2,):
                    xm, kwm = x8[:m].contiguous(), _rows(kw8, slice(0, m))
                    dm = skinny_gemm(xm, w, **kwm)[:1]
                    diff[f"dot M=1 vs M={m}"] += (d1 != dm).sum().item()
            total += n
        line = ", ".join(f"{name} {v}" for name, v in diff.items())
        print(f"  {n}x{k} {kind}: of {total} outputs, differing: {line}; preloads' max |diff| "
              f"vs skinny M=1 {worst:.2e}", flush=True)  # fmt: skip
        counts = "/".join(str(v) for v in diff.values())
        SUMMARY.append((f"bits {n}x{k} pre/M2/M8/dot2", f"{counts} of {total}"))
        SUMMARY.append((f"preload max |diff| {n}x{k}", f"{worst:.2e}"))


# ---------------------------------------------------------------- engine invariance
@section("invariance: Qwen3-0.6B bf16, 4 requests alone vs in batches of 3 / 8 / 17")
def invariance(llm) -> None:
    import random

    from roofline import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    targets = [[rng.randrange(10, 150000) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    fillers = [[rng.randrange(10, 150000) for _ in range(rng.randrange(10, 200))]
               for _ in range(16)]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for on in (False, True):
        set_preload(engine, on)
        tag = "preload" if on else "default"
        for params, what in ((greedy, "tokens"), (with_lp, "logprob bits")):
            for size in (3, 8, 17):
                same = 0
                for t, target in enumerate(targets):
                    engine.kv_manager.reset_prefix_cache()
                    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0]
                    engine.kv_manager.reset_prefix_cache()
                    batch = [fillers[(t + j) % 16] for j in range(size - 1)]
                    batch.insert(t % size, target)
                    outs = llm.generate(batch, params, use_tqdm=False)
                    got = outs[t % size].outputs[0]
                    if what == "tokens":
                        ok = got.token_ids == alone.token_ids
                    else:
                        ok = got.token_ids == alone.token_ids and [
                            d[i].logprob for d, i in zip(got.logprobs, got.token_ids)
                        ] == [d[i].logprob for d, i in zip(alone.logprobs, alone.token_ids)]
                    first = next((j for j, (a, b) in enumerate(zip(got.token_ids,
                                  alone.token_ids)) if a != b), None)  # fmt: skip
                    same += ok
                    if not ok:
                        print(f"    {tag} {what} batch {size} request {t}: first token "
                              f"difference at {first}")  # fmt: skip
                print(f"  {tag}: {what} alone = in a batch of {size}: {same}/4", flush=True)
                SUMMARY.append((f"invariance {tag} {what} bs{size}", f"{same}/4"))
    set_preload(engine, True)


# ---------------------------------------------------------------- timings
def _bs1(engine, ceil, out_len: int) -> float:
    from roofline.bench import latency

    return latency.run(engine, ceil, [1], 128, out_len)[0].output_tok_s


def _host_profile(llm, steps: int = 300) -> None:
    """Where a batch-1 step's host work goes: cProfile over ``steps`` decode steps (its own
    overhead inflates the figures; the shares are what to read)."""
    import cProfile
    import io
    import pstats

    from roofline import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    engine.add_request("host-prof", list(range(10, 138)), params)
    for _ in range(20):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_unfinished_requests():
        engine.step()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()][3:20]
    print(f"  host cProfile, batch 1, {steps} steps (tottime / {steps} = per step):")
    for line in lines:
        print("    " + line[:150])


@section("Qwen3-0.6B decode: preload off / on, batch 1 (median of 6), 8, 64; host; configs")
def qwen3(llm, ceil, quick: bool) -> None:
    from roofline.bench import latency

    engine = llm.llm_engine
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):  # interleaved: two captures per mode, three runs after each
        for on in (False, True):
            set_preload(engine, on)
            runs[on] += [_bs1(engine, ceil, 192) for _ in range(3)]
    for on in (False, True):
        tag = "preload" if on else "default"
        med = statistics.median(runs[on])
        print(f"  bs=1 {tag}: median {med:.1f} tok/s ({', '.join(f'{r:.0f}' for r in runs[on])})")
        SUMMARY.append((f"qwen3-0.6b bs1 {tag}", f"{med:.1f} tok/s"))
    for on in (False, True):
        set_preload(engine, on)
        tag = "preload" if on else "default"
        for r in latency.run(engine, ceil, [8, 64], 128, 128):
            print(f"  bs={r.batch_size} {tag}: {r.step_ms_p50:.3f} ms/step, {r.output_tok_s:.0f} "
                  f"tok/s, {r.roofline_pct:.1f}% of roofline")  # fmt: skip
            SUMMARY.append((f"qwen3-0.6b bs{r.batch_size} {tag}", f"{r.output_tok_s:.0f} tok/s"))
    # host work per step at batch 1 (what step() spends outside the wait for the ids)
    set_preload(engine, True)
    before = engine.step_timing.since(type(engine.step_timing)())
    r = latency.run(engine, ceil, [1], 128, 256)[0]
    t = engine.step_timing.since(before)
    host_ms = (t.total_s - t.wait_s) / t.steps * 1e3
    print(f"  host work per step {host_ms:.3f} ms of {t.total_s / t.steps * 1e3:.3f} ms "
          f"({t.steps} steps; p50 step {r.step_ms_p50:.3f} ms)")  # fmt: skip
    SUMMARY.append(("qwen3-0.6b bs1 host ms/step", f"{host_ms:.3f} of {r.step_ms_p50:.3f}"))
    if quick:
        return
    _host_profile(llm)
    # the preload's program shape in the engine: (BLOCK_N, num_warps) per GEMV
    qkv, o, gu, down = (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)
    variants = {  # base: qkv 8/4, o 4/4, gate_up 8/4, down 4/8 (the first check: 1,318 tok/s;
        # whole rows per warp 1,146, twice the rows 1,212, next layer into L2 1,283)
        "base": {},
        "half_n": {qkv: (4, 4), o: (2, 4), gu: (4, 4), down: (2, 4)},
        "half_qkv_gu": {qkv: (4, 4), gu: (4, 4)},
        "half_o_down": {o: (2, 4), down: (2, 4)},
        "qkv_gu_2w": {qkv: (8, 2), gu: (8, 2)},
        "o_8w": {o: (4, 8)},
        "down_4w": {down: (4, 4)},
    }  # fmt: skip
    from roofline import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for name, table in variants.items():
        gemv_preload.OVERRIDES.clear()
        gemv_preload.OVERRIDES.update(table)
        set_preload(engine, True)
        vals = sorted(_bs1(engine, ceil, 128) for _ in range(3))
        engine.kv_manager.reset_prefix_cache()
        out = llm.generate([list(range(20, 84))], params, use_tqdm=False)[0].outputs[0]
        tokens[name] = out.token_ids
        same = sum(a == b for a, b in zip(tokens[name], tokens["base"]))
        runs3 = ", ".join(f"{v:.0f}" for v in vals)
        print(f"  preload config {name}: {vals[1]:.1f} tok/s (median of {runs3}), greedy tokens "
              f"= base {same}/32", flush=True)  # fmt: skip
        SUMMARY.append((f"qwen3-0.6b bs1 preload {name}", f"{vals[1]:.1f} tok/s, {same}/32"))
        gemv_preload.OVERRIDES.clear()
    # the fused attention's split (fewest tokens per split; a constexpr: graphs recaptured)
    rows: dict[int, list[str]] = {128: [], 1024: []}
    for tokens_per_split in (32, 64, 128):
        decode_attention_fused.set_split_tokens(tokens_per_split)
        set_preload(engine, True)
        for input_len, row in rows.items():
            r = latency.run(engine, ceil, [1], input_len, 128)[0]
            row.append(f"{tokens_per_split}: {r.output_tok_s:.0f}")
    decode_attention_fused.set_split_tokens(64)
    for warps in (2, 8, 4):  # the fused attention's warps per program (4: the default)
        decode_attention_fused.NUM_WARPS = warps
        set_preload(engine, True)
        r = latency.run(engine, ceil, [1], 128, 128)[0]
        print(f"  fused attention with {warps} warps: {r.output_tok_s:.0f} tok/s")
        SUMMARY.append((f"qwen3-0.6b bs1 attention {warps} warps", f"{r.output_tok_s:.0f} tok/s"))
    for input_len, row in rows.items():
        print(f"  split tokens, context {input_len}..{input_len + 128}: {' | '.join(row)} tok/s")
        SUMMARY.append((f"qwen3-0.6b bs1 ctx {input_len} split 32/64/128", " | ".join(row)))
    set_preload(engine, True)
    for use_pdl in (True, False):
        pdl.set_pdl(use_pdl)
        set_preload(engine, True)
        eng = sm._decoding(llm)
        count, top = sm.kernels_per_step(eng, top_n=12)
        while eng.has_unfinished_requests():
            eng.step()
        print(f"  preload, PDL {use_pdl}: {count:.0f} kernels/step (context ~520)")
        for line in top:
            print("      " + line)
    pdl.set_pdl(True)
    set_preload(engine, True)


@section("Llama-3.1-8B decode: preload off / on (regression)")
def llama(ceil) -> None:
    from roofline.bench import latency

    llm = sm.load("llama-3.1-8b", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.6)
    engine = llm.llm_engine
    for on in (False, True):
        set_preload(engine, on)
        tag = "preload" if on else "default"
        rows = latency.run(engine, ceil, [1, 64], 128, 96)
        for r in rows:
            print(f"  llama-3.1-8b bs={r.batch_size} {tag}: {r.step_ms_p50:.3f} ms/step, "
                  f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline")  # fmt: skip
            SUMMARY.append((f"llama-3.1-8b bs{r.batch_size} {tag}", f"{r.output_tok_s:.1f} tok/s"))
    del llm


@section("Qwen3-30B-A3B (8 layers) batch-1 decode: preload off / on (its qkv and o GEMVs)")
def moe(ceil) -> None:
    import json

    from roofline import LLM
    from roofline.bench import latency
    from roofline.models.weights import MODEL_CONFIGS_DIR

    cfg = json.loads((MODEL_CONFIGS_DIR / "qwen3-30b-a3b" / "config.json").read_text())
    cfg["num_hidden_layers"] = 8
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder / "config.json"), load_format="dummy", device="cuda", max_model_len=1024,
              max_num_seqs=8, kv_cache_memory_bytes=2 << 30)  # fmt: skip
    engine = llm.llm_engine
    for on in (False, True, False, True):
        set_preload(engine, on)
        tag = "preload" if on else "default"
        r = latency.run(engine, ceil, [1], 128, 128)[0]
        print(f"  qwen3-30b-a3b 8 layers bs=1 {tag}: {r.step_ms_p50:.3f} ms/step, "
              f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline")  # fmt: skip
        SUMMARY.append((f"qwen3-30b-a3b 8l bs1 {tag}", f"{r.output_tok_s:.1f} tok/s"))
    engine.shutdown()


def _defaults() -> None:
    gemv_preload.OVERRIDES.clear()
    gemv_preload.set_enabled(True)
    decode_attention_fused.set_split_tokens(64)
    decode_attention_fused.NUM_WARPS = 4
    pdl.set_pdl(True)


def main() -> None:
    from roofline.bench.ceilings import measure

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="parity, invariance, timings only")
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
          f"torch {torch.__version__}, PDL {pdl.pdl_enabled()}")  # fmt: skip
    parity_hf()
    if not args.quick:
        kernel_bits()
    llm = None
    try:
        llm = sm.load("qwen3-0.6b", max_model_len=4096, max_num_seqs=64,
                      gpu_memory_utilization=0.4)  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if llm is not None:
        invariance(llm)
        qwen3(llm, ceil, args.quick)
        _defaults()  # whatever a failed sweep left switched
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    llama(ceil)
    if not args.quick:
        moe(ceil)
    print(f"\n=== summary ({time.perf_counter() - t_start:.0f} s)")
    for name, value in SUMMARY:
        print(f"  {name:<44} {value}")


if __name__ == "__main__":
    main()
