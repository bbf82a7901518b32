"""Quantized MoE experts on one GPU (random weights from roofline/model_configs), each section in
try/except so one failure does not hide the others; a short table last. Expert parallelism
needs several GPUs: section 4 runs only with 2+ visible (it is tested on the CPU with gloo,
tests/distributed/test_ep_*.py).

1. Parity: ``fused_moe`` with int8 / fp8 per-channel and int4 g128 experts (decode GEMV and
   grouped GEMM paths) against the dequantize-then-reference loop at Qwen3-30B-A3B and
   Mixtral-8x7B layer shapes; the expert-parallel NOT_LOCAL id (pairs of another rank's
   experts add nothing); a quantized layer captured in a CUDA graph and replayed.
2. The MoE layer alone (routing + fused experts, replayed from a CUDA graph) at 1, 16 and 256
   tokens in bf16, int8, fp8 and int4 (g128): microseconds, GB/s over the bytes of the experts
   the batch touches (the quantized bytes with scales), % of the measured copy bandwidth.
   ``--sweep``: the 8-bit decode GEMV's tiles at 1 token and the grouped GEMM's K tile,
   stages and widening (Triton conversions vs the int8 magic number + TF32) at 16 and 256.
3. Qwen3-30B-A3B batch-1 decode in bf16, int8 and fp8 (and int4 g128 in the full run;
   ``LLM(..., quantization=...)``, experts and linear layers quantized on the fly): tok/s and
   % of the planner's active-parameter roofline at each precision's bytes (random weights are
   drawn differently per precision, so tokens are not compared: section 1 prints each
   scheme's error on the MoE layer against the 16-bit experts it was made from). ``--quick`` (the
   first check, ~90 s): 8 of the 48 layers, parity at Qwen3 shapes only; the full run loads
   all 48 (bf16 ~61 GB, last) and adds Mixtral shapes.

4. (2+ GPUs) a tiny Qwen3-MoE in fp32 at TP = 2 + EP against one GPU (greedy tokens), and
   Qwen3-30B-A3B bf16 decode steps with experts placed whole (EP = 2) vs split (TP = 2).

    python scripts/gpu_moe2.py --quick [--sweep]    # first check (with the 8-bit sweep)
    python scripts/gpu_moe2.py                      # full
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from roofline import LLM, SamplingParams
from roofline.bench import latency
from roofline.bench.ceilings import Ceilings, measure, time_fn
from roofline.kernels import fused_moe as fm
from roofline.models.weights import MODEL_CONFIGS_DIR
from roofline.quantization import formats

SUMMARY: dict[str, object] = {}
TABLE: list[tuple[str, str]] = []
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
KINDS = ("bf16", "int8", "fp8", "int4")
DEVICE = "cuda"


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception:  # report and go on with the next section
                traceback.print_exc()
                TABLE.append((name, "FAILED"))
            finally:
                gc.collect()
                torch.cuda.empty_cache()
                print(f"({name}: {time.perf_counter() - t0:.1f}s)", flush=True)

        return run

    return wrap


def experts(kind: str, e: int, h: int, i: int, gen: torch.Generator):
    """(w13, w2, scales or None, router) on the GPU: bf16 stacks, or per-channel int8 / fp8."""
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, generator=gen).mul_(0.02).bfloat16()
    w2 = torch.randn(e, h, i, device=DEVICE, generator=gen).mul_(0.02).bfloat16()
    router = torch.randn(e, h, device=DEVICE, generator=gen).mul_(0.02).bfloat16()
    if kind == "bf16":
        return w13, w2, None, router
    out = []
    for w in (w13, w2):
        flat = w.reshape(-1, w.shape[-1])
        if kind == "int4":  # group 128, symmetric (quantization="int4")
            q4 = formats.quantize_int4(flat, 128, True, torch.bfloat16)
            rows = (*w.shape[:2], -1)
            out.append(
                (q4.qweight.reshape(rows), q4.scales.reshape(rows), q4.offsets.reshape(rows))
            )
            continue
        if kind == "int8":
            q, s = formats.quantize_int8(flat, flat.shape[1], torch.bfloat16)
        else:
            q, s = formats.quantize_fp8(flat)
        out.append((q.reshape(w.shape), s.reshape(w.shape[:2]).contiguous(), None))
    ORIGINALS[kind] = (w13, w2)  # the 16-bit experts they were made from
    (q13, s13, o13), (q2, s2, o2) = out
    return q13, q2, (s13, s2, o13, o2), router


ORIGINALS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def scale_kwargs(scales) -> dict:
    """fused_moe's quantization arguments from ``experts``' (scales, offsets) tuple."""
    if scales is None:
        return {}
    names = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")
    return {n: t for n, t in zip(names, scales) if t is not None}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def check(name: str, ok: bool, detail: str) -> int:
    print(f"{name}: {detail}", flush=True)
    if not ok:
        TABLE.append((name, f"BAD {detail}"))
    return 0 if ok else 1


def parity_tokens(kind, model, w13, w2, scales, router, k, num_tokens, gen) -> int:
    """Both paths against the dequantized reference, and the NOT_LOCAL half (another rank)."""
    e, h = w13.shape[0], router.shape[1]
    sk = scale_kwargs(scales)
    x = torch.randn(num_tokens, h, device=DEVICE, generator=gen).bfloat16()
    w, ids = fm.route_ref(x @ router.T, k, True)
    ref = fm.fused_moe_ref(x.float(), w13, w2, w.float(), ids, **sk)
    bad = 0
    for path in ("gemv", "grouped") if num_tokens <= 3 else ("grouped",):
        err = rel_err(fm.fused_moe(x, w13, w2, w, ids, force_path=path, **sk), ref)
        bad += check(f"{model} {kind} T={num_tokens} {path}", err < 2e-2, f"rel err {err:.1e}")
    half = e // 2
    mine = ids < half  # experts [half, E) live on "another rank"
    ref_half = fm.fused_moe_ref(
        x.float(), w13, w2, (w * mine).float(), torch.where(mine, ids, 0), **sk
    )
    local_sk = {n: t[:half] for n, t in sk.items()}  # this rank's experts' scales
    out = fm.fused_moe(x, w13[:half], w2[:half], w, torch.where(mine, ids, half), **local_sk)
    err = rel_err(out, ref_half)
    bad += check(f"{model} {kind} T={num_tokens} NOT_LOCAL", err < 2e-2, f"rel err {err:.1e}")
    if num_tokens == 16 and kind in ORIGINALS:  # what quantizing the experts costs the layer
        o13, o2 = ORIGINALS[kind]
        full = fm.fused_moe_ref(x.float(), o13.float(), o2.float(), w.float(), ids)
        q_err = ((ref - full).norm() / full.norm()).item()
        print(f"{model} {kind}: layer output vs the 16-bit experts, rel L2 error {q_err:.2e}")
        TABLE.append((f"{model} {kind} quantization error (layer, rel L2)", f"{q_err:.2e}"))
    return bad


def graph_replay(kind, w13, w2, scales, router, k, num_tokens, gen) -> int:
    """The quantized layer captured once, replayed on new inputs: the eager result."""
    sk = scale_kwargs(scales)
    x = torch.randn(num_tokens, router.shape[1], device=DEVICE, generator=gen).bfloat16()

    def layer():
        w, ids = fm.route(x @ router.T, k, True)
        return fm.fused_moe(x, w13, w2, w, ids, **sk)

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    x.copy_(torch.randn(x.shape, device=DEVICE, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, layer())
    return check(f"{kind} T={num_tokens} CUDA graph replay", same, f"equals eager: {same}")


@section("parity: quantized experts, NOT_LOCAL, CUDA graph")
def parity(models: tuple[str, ...]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bad = 0
    for model in models:
        e, k, h, i = SHAPES[model]
        for kind in ("int8", "fp8", "int4"):
            weights = experts(kind, e, h, i, gen)
            for num_tokens in (1, 3, 16, 256):
                bad += parity_tokens(kind, model, *weights, k, num_tokens, gen)
            if model == "qwen3-30b-a3b":
                for num_tokens in (1, 64):
                    bad += graph_replay(kind, *weights, k, num_tokens, gen)
            del weights
            ORIGINALS.clear()
    TABLE.append(("parity", "ok" if not bad else f"{bad} BAD (listed)"))


def time_layer(x, router, w13, w2, scales, top_k: int, path: str | None = None) -> float:
    """Seconds of routing + fused_moe, replayed from a CUDA graph as decode runs it."""
    sk = scale_kwargs(scales)

    def layer():
        w, ids = fm.route(x @ router.T, top_k, True)
        return fm.fused_moe(x, w13, w2, w, ids, force_path=path, **sk)

    layer()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    return time_fn(graph.replay, torch.device("cuda"), iters=30)


def expert_bytes(w13, w2, scales) -> int:
    total = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    if scales is not None:
        total += sum(s[0].numel() * s.element_size() for s in scales if s is not None)
    return total


GEMV_SWEEP = [  # (BLOCK_N, BLOCK_K, NUM_STAGES, WIDEN); WIDEN 1 changes int8 only
    (8, 512, 3, 0), (16, 512, 3, 0), (8, 1024, 3, 0), (8, 512, 3, 1), (16, 512, 3, 1),
]  # fmt: skip
GEMV_DOWN_SWEEP = [(2, 3), (4, 3)]  # (BLOCK_N, NUM_STAGES) of the down GEMV alone
GEMM_SWEEP = [(64, 4, 0), (128, 3, 0), (64, 4, 1), (128, 3, 1)]  # (BLOCK_K, num_stages, WIDEN)


def sweep_one(kind, label, overrides, table, key_cfg, run) -> None:
    """Time ``run`` under each config in ``key_cfg`` written into ``overrides``; report the best."""
    saved = dict(overrides)
    best = None
    for cfg in key_cfg:
        overrides.clear()
        overrides.update(saved | cfg)
        try:
            t = run()
        except Exception as exc:  # noqa: BLE001 - a config that does not fit
            print(f"  {kind} {label} {cfg}: {exc!r:.100}")
            continue
        print(f"  {kind} {label} {cfg}: {1e6 * t:7.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, cfg)
    overrides.clear()
    overrides.update(saved)
    if best is not None:
        table.append((f"sweep {kind} {label} best", f"{1e6 * best[0]:.1f} us {best[1]}"))
        SUMMARY.setdefault("sweep", {})[f"{kind} {label}"] = (1e6 * best[0], best[1])


def sweep_configs(kind, w13, w2, scales, router, k, gen) -> None:
    """The 8-bit decode GEMV's tiles at 1 token, the grouped GEMM's K tile, stages and
    widening at 16 and 256 tokens (the layer replayed from a CUDA graph each time)."""
    h = router.shape[1]
    wide = (0, 1) if kind == "int8" else (0,)
    x = torch.randn(1, h, device=DEVICE, generator=gen).bfloat16()
    gemv = [
        dict(BLOCK_N=n, BLOCK_K=bk, NUM_STAGES=st, WIDEN=w)
        for n, bk, st, w in GEMV_SWEEP
        if w in wide
    ]
    sweep_one(kind, "gemv T=1", fm.GEMV_CONFIG_8BIT, TABLE, gemv,
              lambda: time_layer(x, router, w13, w2, scales, k, "gemv"))  # fmt: skip
    down = [dict(BLOCK_N=n, NUM_STAGES=st) for n, st in GEMV_DOWN_SWEEP]
    sweep_one(kind, "gemv down T=1", fm.GEMV_DOWN_8BIT, TABLE, down,
              lambda: time_layer(x, router, w13, w2, scales, k, "gemv"))  # fmt: skip
    gemm = [dict(BLOCK_K=bk, num_stages=st, WIDEN=w) for bk, st, w in GEMM_SWEEP]
    for num_tokens in (16, 256):
        xt = torch.randn(num_tokens, h, device=DEVICE, generator=gen).bfloat16()
        sweep_one(kind, f"grouped T={num_tokens}", fm.GEMM_CONFIG_8BIT, TABLE, gemm,
                  lambda xt=xt: time_layer(xt, router, w13, w2, scales, k))  # fmt: skip


@section("MoE layer alone: bf16 vs int8 vs fp8")
def kernel_bench(ceil: Ceilings, sweep: bool) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    bw = ceil.bandwidth_bytes_per_s
    e, k, h, i = SHAPES["qwen3-30b-a3b"]
    rows = []
    for kind in KINDS:
        w13, w2, scales, router = experts(kind, e, h, i, gen)
        per_expert = expert_bytes(w13, w2, scales)
        for num_tokens in (1, 16, 256):
            x = torch.randn(num_tokens, h, device=DEVICE, generator=gen).bfloat16()
            _, ids = fm.route(x @ router.T, k, True)
            touched = int(torch.unique(ids).numel())
            t = time_layer(x, router, w13, w2, scales, k)
            nbytes = touched * per_expert + e * h * 2 + 2 * num_tokens * h * 2
            rows.append(dict(kind=kind, tokens=num_tokens, experts=touched, us=1e6 * t,
                             gbs=nbytes / t / 1e9, pct=100 * nbytes / t / bw))  # fmt: skip
            r = rows[-1]
            print(
                f"qwen3 {kind:4s} T={num_tokens:4d} experts {touched:3d}: {r['us']:7.1f} us "
                f"{r['gbs']:6.0f} GB/s ({r['pct']:5.1f}% of copy)",
                flush=True,
            )
        if sweep and kind in ("int8", "fp8"):
            sweep_configs(kind, w13, w2, scales, router, k, gen)
        del w13, w2, scales, router
        ORIGINALS.clear()
    SUMMARY["kernel"] = rows
    for r in rows:
        TABLE.append(
            (
                f"layer {r['kind']} T={r['tokens']}",
                f"{r['us']:.0f} us, {r['gbs']:.0f} GB/s ({r['pct']:.0f}%)",
            )
        )


def config_with_layers(name: str, num_layers: int) -> str:
    d = json.loads((MODEL_CONFIGS_DIR / name / "config.json").read_text())
    d["num_hidden_layers"] = num_layers
    folder = Path(tempfile.mkdtemp()) / f"{name}-{num_layers}l"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return str(folder / "config.json")


PROMPTS = [list(range(100 + 7 * j, 164 + 7 * j)) for j in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def decode_one(model: str, kind: str, ceil: Ceilings, num_layers: int, steps: int) -> list:
    """One engine of ``kind``: its batch-1 decode row, then its greedy tokens on PROMPTS."""
    box: list = []
    try:
        t0 = time.perf_counter()
        box.append(
            LLM(
                model,
                load_format="dummy",
                device=DEVICE,
                quantization=None if kind == "bf16" else kind,
                max_model_len=1024,
                max_num_seqs=8,
                kv_cache_memory_bytes=2 << 30,
            )
        )
        engine = box[0].llm_engine
        torch.cuda.synchronize()
        gib = torch.cuda.memory_allocated() / 2**30
        print(f"{kind}: loaded in {time.perf_counter() - t0:.1f}s, {gib:.1f} GiB", flush=True)
        rows = latency.run(engine, ceil, [1], 128, steps)
        print(latency.format_rows(rows), flush=True)
        r = rows[0]
        SUMMARY[f"decode_{kind}_{num_layers}l"] = latency.as_dicts(rows)
        TABLE.append(
            (
                f"qwen3-30b-a3b {num_layers}l bs=1 {kind}",
                f"{r.output_tok_s:.0f} tok/s, {r.roofline_pct:.0f}% of roofline "
                f"({r.roofline_step_ms:.2f} ms)",
            )
        )
        outs = box[0].generate(PROMPTS, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        if box:
            box.pop().llm_engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


@section("Qwen3-30B-A3B batch-1 decode: bf16 vs int8 vs fp8 (vs int4)")
def decode(ceil: Ceilings, num_layers: int, steps: int, kinds: tuple[str, ...]) -> None:
    model = "qwen3-30b-a3b" if num_layers == 48 else config_with_layers("qwen3-30b-a3b", num_layers)
    tokens = {}
    for kind in kinds:  # bf16 last: the largest
        try:
            tokens[kind] = decode_one(model, kind, ceil, num_layers, steps)
        except Exception:  # noqa: BLE001 - the next precision still runs
            traceback.print_exc()
            TABLE.append((f"qwen3-30b-a3b {num_layers}l {kind}", "FAILED"))
    # (no token comparison across precisions: random weights are drawn differently for
    # quantized and 16-bit layers; the parity section measures the quantization error instead)
    print("greedy tokens generated per prompt:", {k: len(t[0]) for k, t in tokens.items()})


@section("expert parallelism (2+ GPUs)")
def expert_parallel(ceil: Ceilings, quick: bool) -> None:
    """fp32 greedy parity of a tiny Qwen3-MoE at TP = 2 + EP against one GPU, then Qwen3-30B-A3B
    (48 layers, bf16) decode with experts placed whole (EP) vs split by columns (TP)."""
    if torch.cuda.device_count() < 2:
        TABLE.append(("expert parallelism", "skipped (1 GPU; tested on the CPU with gloo)"))
        return
    from tests.e2e.hf_reference import tiny_hf_model

    path = Path(tempfile.mkdtemp()) / "tiny-qwen3-moe"
    tiny_hf_model("qwen3_moe", path, num_hidden_layers=2)
    got = {}
    for label, kw in (
        ("1 GPU", {}),
        ("TP=2 + EP", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ):
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=256, **kw)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got[label] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
    same = got["1 GPU"] == got["TP=2 + EP"]
    TABLE.append(("tiny qwen3-moe fp32 TP=2+EP vs 1 GPU greedy", "identical" if same else "BAD"))
    for label, kw in (("experts split (TP=2)", {}), ("EP=2", dict(enable_expert_parallel=True))):
        llm = LLM(
            "qwen3-30b-a3b",
            load_format="dummy",
            device="cuda",
            tensor_parallel_size=2,
            max_model_len=1024,
            max_num_seqs=32,
            **kw,
        )
        rows = latency.run(llm.llm_engine, ceil, [1] if quick else [1, 32], 128, 64)
        print(latency.format_rows(rows), flush=True)
        for r in rows:
            TABLE.append(
                (f"qwen3-30b-a3b {label} bs={r.batch_size}", f"{r.step_ms_p50:.3f} ms/step")
            )
        llm.llm_engine.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="the first check: 8 layers")
    ap.add_argument("--sweep", action="store_true", help="sweep the 8-bit kernel configs")
    ap.add_argument("--skip", default="", help="comma-separated: parity,kernel,decode,ep")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    print(
        f"ceilings ({ceil.device_name}): copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    SUMMARY["ceilings"] = vars(ceil)
    if "parity" not in skip:
        parity(("qwen3-30b-a3b",) if args.quick else tuple(SHAPES))
    if "kernel" not in skip:
        kernel_bench(ceil, sweep=args.sweep)
    if "decode" not in skip:
        kinds = ("int8", "fp8", "bf16") if args.quick else ("int8", "fp8", "int4", "bf16")
        decode(ceil, 8 if args.quick else 48, 32 if args.quick else 128, kinds)
    if "ep" not in skip:
        expert_parallel(ceil, args.quick)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f}s)")
    width = max(len(k) for k, _ in TABLE) if TABLE else 0
    for k, v in TABLE:
        print(f"{k:<{width}}  {v}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe2.json", "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
