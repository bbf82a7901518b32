"""Qwen3-30B-A3B batch-1 decode: where the step's time goes, kind by kind, against each kind's
byte floor, the MoE blocks alone, and each shipped batch-1 change turned off again (random
weights; each section in try/except so one failure does not hide the others; a short table
last).

1. Parity on the GPU at Qwen3-30B-A3B shapes: the preloading router kernel
   (``moe_router.PRELOAD``: its rows in registers before the PDL wait, the top-k by rank)
   against the torch reference and the tiled router (same experts, weights within bf16
   rounding); the whole MoE block against the reference; the wide down (``kernels.moe_down``,
   shipped: ``fused_moe.WIDE_DOWN[0]``) against the down GEMV by relative error (they agree to
   an ulp, not bit for bit).
2. Qwen3-30B-A3B, 48 layers, bf16, loaded once (~45-65 s, dummy weights drawn on the GPU):
   batch-1 decode (% of the active-parameter roofline), one profiled batch-1 step grouped by
   kernel kind (router, expert gate/up, expert down, qkv/o GEMV, attention, LM head, other):
   critical-path us a step (a kernel's end minus the previous end, meaningful under PDL's
   overlap), launches, the kind's byte floor at the measured copy rate and its % of it; decode
   at batch 8 / 32 / 128 (% of the touched-experts roofline); with ``--final`` then the
   256-request offline workload, and nothing of 3-4.
3. The MoE blocks of the loaded model alone, all 48 chained in one CUDA graph (the model's
   own weights, no L2 reuse): the router storing its logits only (shipped: the gate/up GEMV
   routes) and the router with its routing, the whole block with the down GEMV and with the
   wide down (shipped), the wide down alone, the gate/up and down GEMVs alone (tiles swept):
   us a layer and % of copy over their bytes.
4. Batch 1 again with each shipped change turned off (decode graph recaptured, then the
   shipped state restored): the down GEMV (before the wide down), the routing in the router
   (before the routing in the gate/up GEMV), the tiled router (before the preloading one), the
   three unfused attention kernels at 32/4/128 (before the fused one, 8 warps, merged by
   split); the best MoE and attention switches (each only if it beat the shipped path)
   measured together and profiled.
5. (``--regress``) Qwen3-0.6B and Llama-3.1-8B batch-1 decode (they share the attention and
   GEMV kernels), before the 48-layer model.
6. (``--quant int8,fp8``) 8 of the 48 layers with 8-bit experts (quantized on the fly):
   batch-1 decode with the down GEMV (shipped) and with the wide down
   (``fused_moe.WIDE_DOWN[1]``).

Its profile helpers (``profile_kinds``, ``recapture_batch1``) are what ``gpu_moe5`` /
``gpu_moe6`` use.

    python scripts/gpu_moe4.py --quick     # first check (~150 s)
    python scripts/gpu_moe4.py --final     # the figures on merged main (~2 min): 2 + offline
    TRITON_INTERPRET=1 python scripts/gpu_moe4.py --dry-run --quant int8   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_moe2 as m2  # noqa: E402 - the section runner, helpers and table

from roofline import LLM  # noqa: E402
from roofline.bench import latency  # noqa: E402
from roofline.bench.ceilings import Ceilings, measure, time_fn  # noqa: E402
from roofline.kernels import decode_attention_fused as attn  # noqa: E402
from roofline.kernels import fused_moe as fm  # noqa: E402
from roofline.kernels import moe_down as md_down  # noqa: E402
from roofline.kernels import moe_router as mr  # noqa: E402
from roofline.layers import fused_decode as fd  # noqa: E402

SUMMARY: dict[str, object] = {}
TABLE = m2.TABLE
DEVICE = "cuda"
DRY = False
"""``--dry-run``: every section on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes (no CUDA
graphs, profiles or recaptures; figures meaningless): the script's code checked, not timed."""
E, K, H, INTER = m2.SHAPES["qwen3-30b-a3b"]
DRY_SHAPES = (16, 4, 64, 32)  # experts, top_k, hidden, moe intermediate of the dry run
ATTN_SHAPE = (32, 4, 128)  # Qwen3-30B-A3B's query heads, KV heads, head_dim
EPS = 1e-6
section = m2.section


def setup(dry: bool) -> Ceilings:
    """The device (the CPU under ``dry``, at ``DRY_SHAPES``) for this module and ``gpu_moe2``,
    and the ceilings (measured on the GPU)."""
    global DRY, DEVICE, E, K, H, INTER
    DRY, DEVICE = dry, "cpu" if dry else "cuda"
    m2.DEVICE = DEVICE
    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1")
        E, K, H, INTER = DRY_SHAPES
        return Ceilings("CPU (dry run)", 1e12, 1e12, "bfloat16")
    ceil = measure(torch.device(DEVICE), torch.bfloat16)
    print(f"ceilings ({ceil.device_name}): copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    SUMMARY["ceilings"] = vars(ceil)
    return ceil


def model_name(name: str, num_layers: int | None = None) -> str:
    """``name`` (``num_layers`` of it where given), or in the dry run a 2-layer config of its
    family at ``DRY_SHAPES`` (the 30B one keeps its GQA group of 8)."""
    if not DRY:
        return name if num_layers is None else m2.config_with_layers(name, num_layers)
    import tempfile

    from roofline.models.weights import MODEL_CONFIGS_DIR

    cfg = json.loads((MODEL_CONFIGS_DIR / name / "config.json").read_text())
    e, k, h, inter = DRY_SHAPES
    cfg.update(num_hidden_layers=2, hidden_size=h, num_attention_heads=8, head_dim=32,
               num_key_value_heads=1 if "a3b" in name else 2, intermediate_size=64,
               vocab_size=512, num_experts=e, num_experts_per_tok=k,
               moe_intermediate_size=inter)  # fmt: skip
    folder = Path(tempfile.mkdtemp()) / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


def steps(n: int) -> int:
    """``n`` decode steps, a few in the dry run."""
    return n if not DRY else min(n, 4)


@section("parity: router kernels, the MoE block and the wide down at Qwen3-30B-A3B shapes")
def parity() -> None:
    try:
        _parity()
    finally:  # the shipped state
        mr.PRELOAD, mr.FORCE_PRELOAD, fm.WIDE_DOWN[0] = True, False, True


def _parity() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bad = 0
    w13, w2, _, router = m2.experts("bf16", E, H, INTER, gen)
    norm_w = (1 + 0.1 * torch.randn(H, device=DEVICE, generator=gen)).bfloat16()
    flips = 0
    seeds = 64 if not DRY else 3
    for seed in range(seeds):
        h = (2 * torch.randn(1, H, device=DEVICE, generator=gen)).bfloat16()
        mr.PRELOAD, mr.FORCE_PRELOAD = True, DRY  # (the interpreter has no PDL: forced)
        xn, w, ids = mr.moe_router(h, norm_w, EPS, router, K, True)
        mr.PRELOAD = mr.FORCE_PRELOAD = False
        xn_t, w_t, ids_t = mr.moe_router(h, norm_w, EPS, router, K, True)
        mr.PRELOAD = True
        xn_r, w_r, ids_r = mr.moe_router_ref(h, norm_w, EPS, router, K, True)
        same_ids = torch.equal(ids, ids_t) and torch.equal(ids, ids_r)
        flips += not same_ids
        err = (w.float() - w_r.float()).abs().max().item()
        if seed < 3 or not same_ids or err > 1e-2:
            bad += m2.check(
                f"router preload seed {seed}",
                err < 1e-2 and m2.rel_err(xn, xn_t.float()) < 1e-2,
                f"ids = tiled: {torch.equal(ids, ids_t)}, = ref: {torch.equal(ids, ids_r)}, "
                f"max |w - w_ref| {err:.1e}, xn = tiled {torch.equal(xn, xn_t)}",
            )
        if seed < 3:
            out = fm.fused_moe(xn, w13, w2, w, ids, residual=h)
            ref = h.float() + fm.fused_moe_ref(xn_r.float(), w13.float(), w2.float(), w_r.float(),
                                               ids_r)  # fmt: skip
            e2 = m2.rel_err(out, ref)
            bad += m2.check(f"MoE block seed {seed}", e2 < 2e-2, f"rel err vs reference {e2:.1e}")
        if seed < 3:  # the wide down (shipped, ``out``) against the down GEMV: to an ulp
            fm.WIDE_DOWN[0] = False
            try:
                gemv = fm.fused_moe(xn, w13, w2, w, ids, residual=h)
            finally:
                fm.WIDE_DOWN[0] = True
            e3 = m2.rel_err(out, gemv.float())
            bad += m2.check(f"wide down seed {seed}", e3 < 1e-2,
                            f"rel err vs the down GEMV {e3:.1e} (bits equal: "
                            f"{torch.equal(out, gemv)})")  # fmt: skip
    print(f"router: expert sets differing from the tiled kernel or the reference: "
          f"{flips}/{seeds}")  # fmt: skip
    TABLE.append(("parity", "ok" if not bad else f"{bad} BAD (listed)"))
    TABLE.append((f"router id flips (near-ties) / {seeds}", str(flips)))


KINDS = [
    ("router", "router"),
    ("skinny_gemm", "qkv/o GEMV"),
    ("gemv_preload", "qkv/o GEMV"),
    ("lm_head", "LM head"),
    ("rotary_kv", "attention"),
    ("decode_split", "attention"),
    ("decode_merge", "attention"),
    ("decode_attention", "attention"),
]
"""(kernel name part, kind) of the batch-1 step's other kernels."""


def kind_of(name: str, after_gate_up: bool) -> str:
    """The kind of a kernel; an expert GEMV right after a gate/up GEMV is the down one."""
    if "_moe_gemv" in name:
        return "expert down" if after_gate_up else "expert gate/up"
    if "_moe_down" in name:  # the wide down (kernels.moe_down)
        return "expert down"
    for key, kind in KINDS:
        if key in name:
            return kind
    return "other"


def floors_bytes(cfg, context: int) -> dict[str, float]:
    """Bytes a batch-1 step must read, per kernel kind (bf16 weights, 16-bit KV cache)."""
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    inter, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "expert gate/up": layers * k * 2 * inter * hidden * 2,
        "expert down": layers * k * inter * hidden * 2,
        "router": layers * cfg.num_experts * hidden * 2,
        "qkv/o GEMV": layers * (hidden * (q + 2 * kv) + q * hidden) * 2,
        "attention": layers * context * 2 * kv * 2,
        "LM head": cfg.vocab_size * hidden * 2,
    }


def profile_kinds(engine, ceil: Ceilings, steps: int, label: str) -> dict[str, float]:
    """One request decoding ``steps`` profiled steps (context ~150 tokens): critical-path us a
    step per kernel kind against its byte floor."""
    import gpu_moe3 as m3

    kernels = m3.profiled_kernels(engine, steps, label)
    share: dict[str, float] = collections.defaultdict(float)
    own: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    last_end = kernels[0][0] if kernels else 0
    idle, after_gate_up = 0.0, False
    for start, end, name in kernels:
        kind = kind_of(name, after_gate_up)
        if "_moe" in name:
            after_gate_up = kind == "expert gate/up"
        share[kind] += max(0.0, end - max(last_end, start))
        own[kind] += end - start
        idle += max(0.0, start - last_end)
        count[kind] += 1
        last_end = max(last_end, end)
    span = (kernels[-1][1] - kernels[0][0]) / steps if kernels else 0.0
    floors = floors_bytes(engine.model_config, 128 + 30 + steps // 2)
    bw = ceil.bandwidth_bytes_per_s
    print(f"profiled {steps} steps ({label}): GPU span {span:.0f} us/step, idle {idle / steps:.0f}"
          f" us/step, {len(kernels) / steps:.0f} kernels/step")  # fmt: skip
    print(f"  {'kind':16s} {'crit us':>8s} {'launches':>8s} {'own us/l':>8s} {'floor us':>8s}"
          f" {'% floor':>7s} {'lost us':>8s}")  # fmt: skip
    rows = {}
    total_floor = 0.0
    for kind in sorted(share, key=lambda n: -share[n]):
        crit = share[kind] / steps
        floor = 1e6 * floors.get(kind, 0.0) / bw
        total_floor += floor
        pct = f"{100 * floor / crit:6.1f}%" if floor and crit else "     -"
        n = count[kind] / steps
        print(f"  {kind:16s} {crit:8.1f} {n:8.0f} {own[kind] / count[kind]:8.2f} {floor:8.1f} "
              f"{pct} {crit - floor:8.1f}")  # fmt: skip
        rows[kind] = dict(crit_us=crit, launches=n, floor_us=floor)
    print(f"  {'idle':16s} {idle / steps:8.1f}; floor of the step {total_floor:.0f} us")
    SUMMARY[f"kinds {label}"] = dict(span_us=span, idle_us=idle / steps, rows=rows)
    TABLE.append((f"bs=1 profile ({label})", f"span {span:.0f} us, idle {idle / steps:.0f} us, "
                  + ", ".join(f"{k} {v['crit_us']:.0f}" for k, v in rows.items())))  # fmt: skip
    return {k: v["crit_us"] for k, v in rows.items()}


def moe_layers(engine) -> list:
    from roofline.layers.moe import FusedMoE

    out = []
    for layer in engine.runner.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, FusedMoE):
            out.append((layer.post_attention_layernorm, mlp))
    return out


def launch_gate_up(xn, moe, ids, w, act, cfg) -> None:
    """fused_moe's gate/up GEMV launch alone (16-bit experts, no PDL)."""
    w13 = moe.w13_weight
    fm._moe_gemv_kernel[(ids.shape[1], triton.cdiv(INTER, cfg["BLOCK_N"]))](
        xn, w13, w13, w13, act, ids, w, act, INTER, H, E, xn.stride(0), w13.stride(0),
        w13.stride(1), w13.stride(0), 1, act.stride(0), act.stride(0), PAIRS_PER_PROGRAM=1,
        A_PER_PAIR=ids.shape[1], SILU_MUL=True, MUL_WEIGHT=False, QUANT=0, GROUP=0,
        RESIDUAL=False, PREFETCH_LINES=1, PDL=False, LINE_BYTES=128, FAST_FP8=True,
        LATE_TRIGGER=False, WIDEN=0, **cfg,
    )  # fmt: skip


def launch_down(act, moe, ids, w, h, out, cfg) -> None:
    w2 = moe.w2_weight
    fm._moe_gemv_kernel[(1, triton.cdiv(H, cfg["BLOCK_N"]))](
        act, w2, w2, w2, out, ids, w, h, H, INTER, E, act.stride(0), w2.stride(0), w2.stride(1),
        w2.stride(0), 1, out.stride(0), h.stride(0), PAIRS_PER_PROGRAM=ids.shape[1],
        A_PER_PAIR=1, SILU_MUL=False, MUL_WEIGHT=True, QUANT=0, GROUP=0, RESIDUAL=True,
        PREFETCH_LINES=1, PDL=False, LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False,
        WIDEN=0, **cfg,
    )  # fmt: skip


def graph_us(fn, n: int) -> float:
    """us of one ``fn()`` (``n`` layers' launches) replayed in a CUDA graph, a layer (the dry
    run: one eager call, timed)."""
    fn()
    if DRY:
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e6 * time_fn(graph.replay, torch.device(DEVICE), iters=20) / n


GATE_UP_SWEEP: list[dict] = []  # first check: the shipped tiles were the best (87.9% of copy)
DOWN_SWEEP = [dict(BLOCK_N=4, BLOCK_K=256, NUM_STAGES=3, num_warps=4)]  # 58.3% vs 54.7%


@section("MoE blocks of the loaded model alone (48 chained, one CUDA graph)")
def block_bench(engine, ceil: Ceilings) -> None:
    from roofline.layers.fused_decode import moe_norm_add

    layers = moe_layers(engine)
    n = len(layers)
    bw = ceil.bandwidth_bytes_per_s
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    dt = layers[0][1].w2_weight.dtype  # the model's (bf16; the dry run's CPU model: fp32)
    h = torch.randn(1, H, device=DEVICE, generator=gen).to(dt)
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:K] for _ in range(n)])
    ids = ids.view(n, 1, K)
    w = torch.full((1, K), 1.0 / K, device=DEVICE, dtype=dt)
    xn = torch.randn(1, H, device=DEVICE, generator=gen).to(dt)
    act = torch.randn(K, INTER, device=DEVICE, generator=gen).to(dt)
    out = torch.empty_like(h)
    gate_up_b = K * 2 * INTER * H * 2
    down_b = K * INTER * H * 2
    router_b = E * H * 2
    block_b = gate_up_b + down_b + router_b

    def pct(us: float, nbytes: float) -> str:
        return f"{us:6.2f} us/layer, {100 * nbytes / (us * 1e-6) / bw:5.1f}% of copy"

    def chain_block():
        x = h
        for norm, moe in layers:
            x = moe_norm_add(moe, norm, x)

    def chain_logits():  # the shipped router: logits only, the gate/up GEMV routes
        for norm, moe in layers:
            if mr.router_logits(h, norm.weight, norm.eps, moe.gate.weight) is None:
                raise RuntimeError("the preloading router does not apply (PDL off?)")

    def chain_router():  # the router's own routing (with MOE_ROUTE_IN_GATE_UP off)
        for norm, moe in layers:
            mr.moe_router(h, norm.weight, norm.eps, moe.gate.weight, moe.top_k, moe.renormalize)

    def chain_wide_down():  # the wide down alone (fused_moe's one-token call)
        for i, (_, moe) in enumerate(layers):
            md_down.moe_down_wide(act, moe.w2_weight, w, ids[i], out, h)

    results = {}
    rows = (("router, logits only (shipped)", chain_logits, router_b, None),
            ("router with its routing", chain_router, router_b, None),
            ("whole block, down GEMV", chain_block, block_b, False),
            ("whole block, wide down (shipped)", chain_block, block_b, True),
            ("wide down alone", chain_wide_down, down_b, None))  # fmt: skip
    mr.FORCE_PRELOAD = DRY  # (the interpreter has no PDL)
    try:
        for label, fn, nbytes, wide in rows:
            try:
                if wide is not None:
                    fm.WIDE_DOWN[0] = wide
                us = graph_us(fn, n)
                results[label] = us
                print(f"{label:32s}: {pct(us, nbytes)}", flush=True)
                TABLE.append((f"MoE {label}", pct(us, nbytes)))
            except Exception as exc:  # noqa: BLE001 - the next row still runs
                print(f"{label}: {type(exc).__name__} {str(exc)[:100]}")
            finally:
                fm.WIDE_DOWN[0] = True
    finally:
        mr.FORCE_PRELOAD = False
    base_up = {k: fm.GEMV_CONFIG[k] for k in ("BLOCK_N", "BLOCK_K", "NUM_STAGES", "num_warps")}
    if DRY:  # the interpreter's tiles (fused_moe narrows BLOCK_K the same way)
        base_up["BLOCK_K"] = min(base_up["BLOCK_K"], triton.next_power_of_2(max(H, INTER)))
    for which, sweep, nbytes in (("gate/up", GATE_UP_SWEEP, gate_up_b),
                                 ("down", DOWN_SWEEP, down_b)):  # fmt: skip
        swept = []
        for cfg in [base_up] + (sweep if not DRY else []):
            try:
                if which == "gate/up":
                    fn = lambda c=cfg: [launch_gate_up(xn, moe, ids[i], w, act, c)  # noqa: E731
                                        for i, (_, moe) in enumerate(layers)]  # fmt: skip
                else:
                    fn = lambda c=cfg: [launch_down(act, moe, ids[i], w, h, out, c)  # noqa: E731
                                        for i, (_, moe) in enumerate(layers)]  # fmt: skip
                us = graph_us(fn, n)
                swept.append((us, cfg))
                tag = "(shipped tiles)" if cfg is base_up else ""
                print(f"{which:7s} GEMV {str(cfg):65s}: {pct(us, nbytes)} {tag}", flush=True)
            except Exception as exc:  # noqa: BLE001 - the next config still runs
                print(f"{which:7s} GEMV {cfg}: {type(exc).__name__} {str(exc)[:100]}")
        if swept:
            us, cfg = min(swept, key=lambda r: r[0])
            results[f"{which} GEMV shipped"] = swept[0][0]
            results[f"{which} GEMV best"] = us
            TABLE.append((f"MoE {which} GEMV alone", f"shipped tiles {pct(swept[0][0], nbytes)};"
                          f" best {pct(us, nbytes)} {cfg}"))  # fmt: skip
    SUMMARY["block_bench"] = results


def recapture_batch1(runner) -> None:
    """The runner's decode graph for batch 1 again (``gpu_moe3``'s; none in the dry run)."""
    import gpu_moe3 as m3

    if not DRY:
        m3.recapture_batch1(runner)


def _switches() -> dict:
    """label: (turn one shipped batch-1 change off, restore the shipped state)."""
    return {  # ATTENTION_SIDE names the attention's
        "down GEMV (before the wide down)": (
            lambda: fm.WIDE_DOWN.update({0: False}),
            lambda: fm.WIDE_DOWN.update({0: True}),
        ),
        "routing in the router (before the routing in the gate/up GEMV)": (
            lambda: setattr(fd, "MOE_ROUTE_IN_GATE_UP", False),
            lambda: setattr(fd, "MOE_ROUTE_IN_GATE_UP", True),
        ),
        # the tiled router has no logits-only form: it routes too (moe_norm_add falls back)
        "router tiled (before the preloading router)": (
            lambda: setattr(mr, "PRELOAD", False),
            lambda: setattr(mr, "PRELOAD", True),
        ),
        "attention: three unfused kernels (before)": (
            lambda: attn.UNFUSED_FASTER.add(ATTN_SHAPE),
            lambda: attn.UNFUSED_FASTER.discard(ATTN_SHAPE),
        ),
    }


ATTENTION_SIDE = ("attention: three unfused kernels (before)",)
"""The switches of the attention; every other one changes the MoE block (one of each kind
combines)."""


@section("Qwen3-30B-A3B, 48 layers, bf16")
def full_model(ceil: Ceilings, quick: bool, final: bool = False) -> None:
    t0 = time.perf_counter()
    llm = LLM(model_name("qwen3-30b-a3b"), load_format="dummy", device=DEVICE, max_model_len=2048,
              max_num_seqs=128, **({} if DRY else dict(gpu_memory_utilization=0.92)))  # fmt: skip
    gib = 0.0 if DRY else (torch.cuda.synchronize(), torch.cuda.memory_allocated() / 2**30)[1]
    print(f"loaded 48 layers in {time.perf_counter() - t0:.1f}s, {gib:.1f} GiB", flush=True)
    engine = llm.llm_engine
    rows = latency.run(engine, ceil, [1], 128, steps(128))
    print(latency.format_rows(rows), flush=True)
    r = rows[0]
    SUMMARY["bs1"] = latency.as_dicts(rows)
    TABLE.append(("48l bs=1 bf16 (shipped)", f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}%"
                  f" of roofline {r.roofline_step_ms:.2f} ms, step {r.step_ms_p50:.3f} ms "
                  "(goal 70%)"))  # fmt: skip
    try:
        if not DRY:  # (the CUDA profiler's)
            profile_kinds(engine, ceil, 8, "shipped")
    except Exception:  # noqa: BLE001 - the figures above stand without the profile
        traceback.print_exc()
    sizes = [8, 32, 128] if not DRY else [8]
    rows = latency.run(engine, ceil, sizes, 128, steps(64))  # the engine's own graphs
    print(latency.format_rows(rows), flush=True)
    SUMMARY["decode_48l"] = latency.as_dicts(rows)
    for r in rows:
        TABLE.append((f"48l bs={r.batch_size} step", f"{r.step_ms_p50:.2f} ms, "
                      f"{r.roofline_pct:.1f}% of touched-experts roofline"))  # fmt: skip
    if final and not DRY:  # the figures only: the offline workload, not the benches/switches
        import gpu_moe3 as m3

        m3.SUMMARY = SUMMARY
        m3.offline(llm, ceil)
        engine.shutdown()
        return
    block_bench(engine, ceil)
    runner = engine.runner  # the variants recapture the batch-1 graph only
    variants = {}
    for label, (on, off) in [("shipped (recaptured)", (lambda: None, lambda: None))] + list(
        _switches().items()
    ):
        try:
            on()
            recapture_batch1(runner)
            r = latency.run(engine, ceil, [1], 128, steps(48))[0]
            variants[label] = r.step_ms_p50
            print(f"48l bs=1 {label:52s}: {r.output_tok_s:6.1f} tok/s, step {r.step_ms_p50:.3f}"
                  f" ms, {r.roofline_pct:5.1f}%", flush=True)  # fmt: skip
            TABLE.append((f"48l bs=1 {label}", f"{r.output_tok_s:.1f} tok/s, "
                          f"{r.roofline_pct:.1f}%"))  # fmt: skip
        except Exception:  # noqa: BLE001 - the next variant still runs
            traceback.print_exc()
            TABLE.append((f"48l bs=1 {label}", "FAILED"))
        finally:
            off()
    SUMMARY["variants_ms"] = variants
    base = variants.get("shipped (recaptured)", float("inf"))
    sides = [[k for k in variants if (k in ATTENTION_SIDE) == att and k != "shipped (recaptured)"]
             for att in (False, True)]  # fmt: skip
    best = [min(side, key=variants.get) for side in sides if side]
    best = [k for k in best if variants[k] < base]  # only what beat the shipped path
    switches = _switches()
    combo = " + ".join(best) if best else "shipped (recaptured)"
    print(f"best of each kind: {best or 'none beat the shipped path'}", flush=True)
    try:
        for k in best:
            switches[k][0]()
        recapture_batch1(runner)
        if len(best) > 1:
            r = latency.run(engine, ceil, [1], 128, steps(128))[0]
            print(f"48l bs=1 {combo}: {r.output_tok_s:6.1f} tok/s, step {r.step_ms_p50:.3f} ms, "
                  f"{r.roofline_pct:5.1f}%", flush=True)  # fmt: skip
            TABLE.append((f"48l bs=1 COMBINED {combo}", f"{r.output_tok_s:.1f} tok/s, "
                          f"{r.roofline_pct:.1f}%, step {r.step_ms_p50:.3f} ms"))  # fmt: skip
        if not DRY:
            profile_kinds(engine, ceil, 8, combo)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for k in best:
            switches[k][1]()
    engine.shutdown()


KV_BYTES = {False: 2 << 30, True: 64 << 20}  # the small engines' KV cache (GPU, dry run)


@section("dense models at batch 1 (shared layers: no regression)")
def dense(ceil: Ceilings) -> None:
    import gc

    for model, floor in (("qwen3-0.6b", 1250.0), ("llama-3.1-8b", 175.0)):
        llm = LLM(model_name(model), load_format="dummy", device=DEVICE, max_model_len=1024,
                  max_num_seqs=8, kv_cache_memory_bytes=KV_BYTES[DRY])  # fmt: skip
        try:
            r = latency.run(llm.llm_engine, ceil, [1], 128, steps(128))[0]
            print(f"{model} bs=1: {r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline "
                  f"(keep >= {floor:.0f})", flush=True)  # fmt: skip
            SUMMARY[f"{model} bs1"] = r.output_tok_s
            TABLE.append((f"{model} bs=1", f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% "
                          f"(keep >= {floor:.0f})"))  # fmt: skip
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()


@section("8 layers, 8-bit experts at batch 1: down GEMV vs wide down")
def quant8(ceil: Ceilings, kinds: tuple[str, ...]) -> None:
    import gc

    model = model_name("qwen3-30b-a3b", 8)
    for kind in kinds:
        llm = LLM(model, load_format="dummy", device=DEVICE, quantization=kind,
                  max_model_len=1024, max_num_seqs=8,
                  kv_cache_memory_bytes=KV_BYTES[DRY])  # fmt: skip
        engine = llm.llm_engine
        try:  # WIDE_DOWN[1]: 8-bit experts only (int4 keeps the down GEMV)
            for wide in (False, True) if kind != "int4" else (False,):
                fm.WIDE_DOWN[1] = wide
                recapture_batch1(engine.runner)
                r = latency.run(engine, ceil, [1], 128, steps(64))[0]
                tag = "wide down" if wide else "down GEMV"
                line = f"{r.output_tok_s:7.1f} tok/s, step {r.step_ms_p50:.3f} ms"
                print(f"8l {kind} bs=1 {tag:10s}: {line}, {r.roofline_pct:5.1f}% of roofline")
                TABLE.append((f"8l {kind} bs=1 {tag}", f"{r.output_tok_s:.0f} tok/s, "
                              f"{r.roofline_pct:.1f}%"))  # fmt: skip
        finally:
            fm.WIDE_DOWN[1] = False  # shipped: 8-bit experts keep the down GEMV
            engine.shutdown()
            del llm, engine
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--final", action="store_true", help="figures only: bs 1/8/32/128, offline")
    ap.add_argument("--regress", action="store_true", help="also Qwen3-0.6B and Llama-3.1-8B bs=1")
    ap.add_argument("--quant", default="", help="comma-separated int8,fp8,int4: 8-layer bs=1")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = setup(args.dry_run)
    if not args.final:
        parity()
    if args.regress:
        dense(ceil)
    full_model(ceil, args.quick, args.final)
    if args.quant:
        quant8(ceil, tuple(args.quant.split(",")))
    print(f"\n=== summary ({time.perf_counter() - t0:.0f}s)")
    width = max(len(k) for k, _ in TABLE) if TABLE else 0
    for k, v in TABLE:
        print(f"{k:<{width}}  {v}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe4.json", "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
