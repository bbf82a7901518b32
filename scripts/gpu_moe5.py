"""Qwen3-30B-A3B batch-1 decode as shipped (issue 18: >= 70% of the active-parameter roofline),
checked and timed in one call, with each batch-1 change turned off again to show what it is
worth (random weights; each section in try/except; a table last). Its helpers (parity cases,
the batch-1 row, the recapture, the ablation, the dense rows) are imported by
``scripts/gpu_moe6.py``, which adds the down kernel's parity.

The shipped batch-1 path (H100, 48 layers: 3.381 ms a step before the first, 2.898 with all):

* The fused decode attention at the 8-wide GQA group (``decode_attention_fused``,
  ``MERGE_BY_SPLIT_GROUPS`` and ``WIDE_GROUP_WARPS``): one launch instead of three, 8 warps,
  the last split merging all the group's heads at once; off = (32, 4, 128) back in
  ``UNFUSED_FASTER``.
* The MoE routing in the gate/up GEMV (``fused_decode.MOE_ROUTE_IN_GATE_UP``, one copy of the
  logits a warp: ``moe_topk.pick_rank``): the router stores its logits only and each gate/up
  program takes the top-k itself; off = the router's last program routes.
* The down projection with all k experts' rows in one program's tile (``kernels.moe_down``,
  ``fused_moe.WIDE_DOWN``); off = the down GEMV (the split down it replaced is gone).

Sections: 1. GPU parity: the fused attention at 32/4/128 against the torch reference (q/k
norm, bf16; 3 and 16 splits), in a CUDA graph too, counters back at zero; the MoE block routed
in the gate/up GEMV against the router-routed one (same ids, weights and output to an ulp),
eager and in a graph. 2. The 48-layer model: batch 1 (128 steps), profiled by kernel kind
against each kind's byte floor; batch 8 / 32; batch 1 with each change off (the decode graph
recaptured). 3. Qwen3-0.6B and Llama-3.1-8B at batch 1 (the floors they must keep).

    python scripts/gpu_moe5.py              # ~170 s on one H100
    TRITON_INTERPRET=1 python scripts/gpu_moe5.py --dry-run   # CPU: every section, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_moe2 as m2  # noqa: E402 - the section runner, check / rel_err, the table
import gpu_moe4 as m4  # noqa: E402 - setup, the profile by kernel kind, the batch-1 recapture

from roofline.bench.ceilings import Ceilings  # noqa: E402
from roofline.kernels import decode_attention_fused as fa  # noqa: E402
from roofline.kernels import fused_moe as fm  # noqa: E402
from roofline.kernels import last_program  # noqa: E402
from roofline.kernels import moe_router as mr  # noqa: E402
from roofline.layers import fused_decode as fd  # noqa: E402

TABLE = m2.TABLE
SUMMARY: dict[str, object] = {}
DRY = False
DEVICE = "cuda"
T0 = time.perf_counter()
BUDGET_S = 230.0  # the run's whole budget: later rows are skipped as it runs out
SHAPE = (32, 4, 128)  # Qwen3-30B-A3B's query heads, KV heads, head_dim
DENSE = (("qwen3-0.6b", 1250.0), ("llama-3.1-8b", 169.0))  # batch-1 tok/s each must keep


def left_s() -> float:
    return BUDGET_S - (time.perf_counter() - T0)


def setup(dry: bool) -> Ceilings:
    """``gpu_moe4.setup`` (the device for it and ``gpu_moe2``: the CPU under ``dry``; the
    ceilings, measured on the GPU), then the same device for this module."""
    global DRY, DEVICE
    ceil = m4.setup(dry)
    DRY, DEVICE = m4.DRY, m4.DEVICE
    SUMMARY["ceilings"] = vars(ceil)
    return ceil


def shipped_switches() -> dict[str, tuple]:
    """label: (turn the shipped change off, turn it back on)."""
    return {
        "fused attention off (three unfused kernels)": (
            lambda: fa.UNFUSED_FASTER.add(SHAPE), lambda: fa.UNFUSED_FASTER.discard(SHAPE)),
        "routing in the router (not in the gate/up GEMV)": (
            lambda: setattr(fd, "MOE_ROUTE_IN_GATE_UP", False),
            lambda: setattr(fd, "MOE_ROUTE_IN_GATE_UP", True)),
        "the down GEMV (not the wide down)": (
            lambda: fm.WIDE_DOWN.update({0: False}), lambda: fm.WIDE_DOWN.update({0: True})),
    }  # fmt: skip


# ---------------------------------------------------------------- 1. parity


def attention_case(context: int, heads: tuple[int, int, int], gen: torch.Generator):
    """One request with ``context`` cached tokens in permuted 16-token pages: q/k/v views of one
    QKV row, positions, cos/sin, q/k norms, caches, slot, block table, seq_lens."""
    num_heads, num_kv, head_dim = heads
    page, dev, dt = 16, DEVICE, torch.bfloat16
    seq_len = context + 1
    num_pages = (seq_len + page - 1) // page + 2
    shape = (num_pages, page, num_kv, head_dim)
    k_cache = torch.randn(shape, device=dev, generator=gen).to(dt)
    v_cache = torch.randn(shape, device=dev, generator=gen).to(dt)
    pages = torch.randperm(num_pages, device=dev, generator=gen)[: (seq_len + page - 1) // page]
    block_table = pages.to(torch.int32)[None, :]  # [1, blocks]
    slot = (pages[context // page] * page + context % page).view(1).long()
    sizes = [num_heads * head_dim, num_kv * head_dim, num_kv * head_dim]
    qkv = torch.randn(1, sum(sizes), device=dev, generator=gen).to(dt)
    q, k, v = qkv.split(sizes, dim=-1)
    q = q.view(1, num_heads, head_dim)
    k, v = k.view(1, num_kv, head_dim), v.view(1, num_kv, head_dim)
    norm_w = (1 + 0.3 * torch.randn(2, head_dim, device=dev, generator=gen)).to(dt)
    norms = (norm_w[0], norm_w[1], 1e-6)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, head_dim]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    positions = torch.tensor([context], device=dev)
    return q, k, v, positions, cos_sin, norms, k_cache, v_cache, slot, block_table, seq_lens


def graph_equals_eager(fn, eager: torch.Tensor) -> bool:
    """Three replays of ``fn`` captured in a CUDA graph give ``eager``'s bits (True when dry)."""
    if DRY:
        return True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out = out[0] if isinstance(out, tuple) else out
    return all((graph.replay(), torch.equal(out, eager))[1] for _ in range(3))


def attention_parity(gen: torch.Generator) -> int:
    """The shipped fused attention at Qwen3-30B-A3B's heads against the torch reference."""
    heads = SHAPE if not DRY else (16, 2, 32)  # the dry run keeps the group of 8
    assert heads[0] // heads[1] == 8 and 8 in fa.MERGE_BY_SPLIT_GROUPS
    bad = 0
    for context in (150, 1000) if not DRY else (150,):  # 3 splits (one merge round), 16
        case = attention_case(context, heads, gen)
        q, k, v, pos, cos_sin, norms, kc, vc, slot, bt, seq_lens = case
        kc2, vc2 = kc.clone(), vc.clone()
        ref = fa.fused_decode_attention_ref(q.clone(), k.clone(), v.clone(), pos, cos_sin, norms,
                                            kc2, vc2, slot, bt, seq_lens, 0.088)  # fmt: skip
        run = lambda c=case: fa.fused_decode_attention(*c, 0.088, 2048)  # noqa: E731
        out = run()
        err = m2.rel_err(out, ref.float())
        cache_ok = torch.equal(vc, vc2) and m2.rel_err(kc, kc2.float()) < 1e-2
        graph_ok = graph_equals_eager(run, out)
        zeroed = not last_program._COUNTERS[(out.device, "attention")].any()
        bad += m2.check(f"fused attention 32/4/128 (shipped), context {context}",
                        err < 2e-2 and cache_ok and graph_ok and zeroed,
                        f"rel err {err:.1e}, cache {cache_ok}, graph = eager {graph_ok}, "
                        f"counters zeroed {zeroed}")  # fmt: skip
    return bad


def moe_block(gen: torch.Generator) -> tuple:
    """Random Qwen3-30B-A3B MoE block weights (bf16): w13, w2, router, norm weight, top_k."""
    E, K, H, INTER = m2.SHAPES["qwen3-30b-a3b"] if not DRY else m4.DRY_SHAPES
    w13 = (0.02 * torch.randn(E, 2 * INTER, H, device=DEVICE, generator=gen)).bfloat16()
    w2 = (0.02 * torch.randn(E, H, INTER, device=DEVICE, generator=gen)).bfloat16()
    router = (0.02 * torch.randn(E, H, device=DEVICE, generator=gen)).bfloat16()
    nw = (1 + 0.1 * torch.randn(H, device=DEVICE, generator=gen)).bfloat16()
    return w13, w2, router, nw, K


def routed_by_router(h, block) -> tuple[torch.Tensor, ...]:
    """The MoE block at one token with the router kernel's routing: out [1, H], ids and
    weights [1, k]."""
    w13, w2, router, nw, k = block
    xn, w, ids = mr.moe_router(h, nw, 1e-6, router, k, True)
    return fm.fused_moe(xn, w13, w2, w, ids, residual=h), ids, w


def routed_in_gate_up(h, block) -> tuple[torch.Tensor, ...]:
    """The same block routed by the gate/up GEMV (the shipped one-token path)."""
    w13, w2, router, nw, k = block
    xn, logits = mr.router_logits(h, nw, 1e-6, router)
    w = torch.empty(1, k, dtype=h.dtype, device=h.device)
    ids = torch.empty(1, k, dtype=torch.int64, device=h.device)
    return fm.fused_moe(xn, w13, w2, w, ids, residual=h, route_logits=(logits, True)), ids, w


def route_parity(gen: torch.Generator) -> int:
    block = moe_block(gen)
    mr.FORCE_PRELOAD = DRY  # the preloading router is PDL's (the interpreter has none)
    bad = 0
    try:
        for seed in range(3):
            h = (2 * torch.randn(1, block[0].shape[2], device=DEVICE, generator=gen)).bfloat16()
            a, ids_a, w_a = routed_by_router(h, block)
            b, ids_b, w_b = routed_in_gate_up(h, block)
            same_ids, bits = torch.equal(ids_a, ids_b), torch.equal(a, b)
            err_w, err = m2.rel_err(w_b, w_a.float()), m2.rel_err(b, a.float())
            graph_ok = graph_equals_eager(lambda h=h: routed_in_gate_up(h, block), b)
            bad += m2.check(f"MoE routing in the gate/up GEMV (shipped), seed {seed}",
                            same_ids and err_w < 1e-2 and err < 1e-2 and graph_ok,
                            f"ids = router's {same_ids}, weights rel err {err_w:.1e}, "
                            f"output rel err {err:.1e} (bits {bits}), graph = eager "
                            f"{graph_ok}")  # fmt: skip
    finally:
        mr.FORCE_PRELOAD = False
    return bad


@m2.section("parity: the shipped fused attention at 32/4/128 and the routing in the gate/up GEMV")
def parity() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bad = attention_parity(gen) + route_parity(gen)
    TABLE.append(("parity (shipped)", "ok" if not bad else f"{bad} BAD (listed)"))


# ---------------------------------------------------------------- 2. the 48-layer model


def model_name(name: str) -> str:
    """``name``, or in the dry run a 2-layer config of its family small enough for the CPU (the
    30B one keeps its GQA group of 8)."""
    if not DRY:
        return name
    import tempfile

    from roofline.models.weights import MODEL_CONFIGS_DIR

    cfg = json.loads((MODEL_CONFIGS_DIR / name / "config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, head_dim=32,
               num_key_value_heads=1 if "a3b" in name else 2, intermediate_size=64,
               vocab_size=512, num_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=32)  # fmt: skip
    folder = Path(tempfile.mkdtemp()) / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


def load_30b():
    from roofline import LLM

    t0 = time.perf_counter()
    llm = LLM(model_name("qwen3-30b-a3b"), load_format="dummy", device=DEVICE, max_model_len=2048,
              max_num_seqs=128, **({} if DRY else dict(gpu_memory_utilization=0.92)))  # fmt: skip
    print(f"loaded 48 layers in {time.perf_counter() - t0:.1f}s", flush=True)
    return llm


def bs1(engine, ceil: Ceilings, label: str, steps: int = 48):
    from roofline.bench import latency

    r = latency.run(engine, ceil, [1], 128, steps if not DRY else min(steps, 6))[0]
    print(f"bs=1 {label:62s}: {r.output_tok_s:7.1f} tok/s, step {r.step_ms_p50:.3f} ms, "
          f"{r.roofline_pct:5.1f}%", flush=True)  # fmt: skip
    return r


def batches(engine, ceil: Ceilings, label: str) -> None:
    """Batch 8 and 32 on the engine's graphs (captured up to 32 rows), into the table."""
    from roofline.bench import latency

    for r in latency.run(engine, ceil, [8, 32], 128, 48 if not DRY else 2):
        TABLE.append((f"48l bs={r.batch_size} {label}", f"{r.step_ms_p50:.2f} ms, "
                      f"{r.roofline_pct:.1f}% of touched-experts roofline"))  # fmt: skip


def profile(engine, ceil: Ceilings, label: str) -> None:
    """8 profiled batch-1 steps by kernel kind against each kind's floor (not in the dry run)."""
    if not DRY:
        m4.profile_kinds(engine, ceil, 8, label)


def recapture(runner, max_batch: int = 1) -> None:
    """The runner's decode graphs again, buckets up to ``max_batch`` (the dry run has none)."""
    if DRY:
        return
    if max_batch == 1:
        m4.recapture_batch1(runner)
        return
    from roofline.worker.cuda_graph import DecodeGraphs

    runner.graphs = None
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.backend, max_batch,
                                 runner.scheduler_config.max_model_len, runner.page_size,
                                 runner.device, heads=True)  # fmt: skip
    runner.graphs.capture()


def measure_variant(engine, ceil: Ceilings, label: str, on, off, ref_ms: float,
                    variants: dict) -> None:  # fmt: skip
    """Batch 1 with ``on()`` applied (the batch-1 graph recaptured), then ``off()``."""
    if left_s() < 40:
        print(f"(skipped, {left_s():.0f} s left: {label})")
        return
    try:
        on()
        recapture(engine.runner)
        r = bs1(engine, ceil, label)
        variants[label] = r.step_ms_p50
        TABLE.append((f"48l bs=1 {label}", f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}%, "
                      f"{1e3 * (r.step_ms_p50 - ref_ms):+.0f} us/step"))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the next variant still runs
        print(f"bs=1 {label}: FAILED {type(exc).__name__} {str(exc)[:300]}")
        TABLE.append((f"48l bs=1 {label}", "FAILED"))
    finally:
        off()


@m2.section("Qwen3-30B-A3B, 48 layers, bf16: the shipped batch-1 path and each change off")
def full_model(ceil: Ceilings) -> None:
    llm = load_30b()
    engine = llm.llm_engine
    base = bs1(engine, ceil, "shipped", 128 if not DRY else 8)
    SUMMARY["bs1 shipped"] = vars(base)
    TABLE.append(("48l bs=1 shipped", f"{base.output_tok_s:.1f} tok/s, {base.roofline_pct:.1f}% "
                  f"of roofline {base.roofline_step_ms:.3f} ms, step {base.step_ms_p50:.3f} ms "
                  f"(goal 70%: <= {base.roofline_step_ms / 0.7:.3f} ms)"))  # fmt: skip
    profile(engine, ceil, "shipped")
    batches(engine, ceil, "shipped")  # before any recapture keeps batch 1 only
    variants = {"shipped": base.step_ms_p50}
    for label, (off, on) in shipped_switches().items():
        measure_variant(engine, ceil, label, off, on, base.step_ms_p50, variants)
    SUMMARY["variants_ms"] = variants
    engine.shutdown()


# ---------------------------------------------------------------- 3. dense models


def dense_rows(ceil: Ceilings, variants: dict[str, tuple] | None = None) -> None:
    """Batch 1 of each DENSE model as shipped, then under each ``label: (on, off)``."""
    import gc

    from roofline import LLM
    from roofline.bench import latency

    for model, floor in DENSE:
        if left_s() < 25:
            print(f"(skipped, {left_s():.0f} s left: {model})")
            continue
        llm = LLM(model_name(model), load_format="dummy", device=DEVICE, max_model_len=1024,
                  max_num_seqs=8, kv_cache_memory_bytes=2 << 30)  # fmt: skip
        engine = llm.llm_engine
        try:
            rows = [("shipped", None, None)] + [(k, *v) for k, v in (variants or {}).items()]
            for label, on, off in rows:
                if on is not None:
                    on()
                    recapture(engine.runner)
                try:
                    r = latency.run(engine, ceil, [1], 128, 128 if not DRY else 4)[0]
                finally:
                    if off is not None:
                        off()
                line = f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}%"
                line += f" (keep >= {floor:.0f})" if on is None else ""
                print(f"{model} bs=1 {label}: {line}", flush=True)
                TABLE.append((f"{model} bs=1 {label}", line))
        finally:
            engine.shutdown()
            del llm, engine
            gc.collect()
            if not DRY:
                torch.cuda.empty_cache()


@m2.section("dense models at batch 1 (the floors they keep)")
def dense(ceil: Ceilings) -> None:
    dense_rows(ceil)


def print_table() -> None:
    print(f"\n=== summary ({time.perf_counter() - T0:.0f}s)")
    width = max(len(k) for k, _ in TABLE) if TABLE else 0
    for k, v in TABLE:
        print(f"{k:<{width}}  {v}")


def decision() -> None:
    print("\n=== decision (batch 1, 48 layers; the goal: 70% of the active-parameter roofline)")
    base = SUMMARY.get("bs1 shipped")
    if not base:
        print("the shipped batch-1 row did not run")
        return
    goal_ms = base["roofline_step_ms"] / 0.70
    met = "MET" if base["step_ms_p50"] <= goal_ms else "NOT met"
    print(f"shipped: {base['step_ms_p50']:.3f} ms, {base['roofline_pct']:.1f}% ({met}: "
          f"<= {goal_ms:.3f} ms)")  # fmt: skip
    for label, ms in SUMMARY.get("variants_ms", {}).items():
        if label != "shipped":
            print(f"  {label:60s} {ms:.3f} ms ({1e3 * (ms - base['step_ms_p50']):+.0f} us: what "
                  "the change is worth)")  # fmt: skip


def main() -> None:
    global BUDGET_S
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-dense", action="store_true", help="skip Qwen3-0.6B / Llama-3.1-8B")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    args = ap.parse_args()
    BUDGET_S = args.budget
    ceil = setup(args.dry_run)
    parity()
    full_model(ceil)
    if not args.no_dense:
        dense(ceil)
    print_table()
    decision()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe5.json", "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
