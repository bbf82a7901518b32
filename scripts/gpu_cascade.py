"""Cascade (shared-prefix) decode attention on the GPU, in one process (< 4 min on one H100;
``--quick`` ~2.5 min). Sections, in the order they run (the engine figures first):

1. parity of ``cascade_attention`` against the plain decode kernel and the torch reference
   (Llama-3.1-8B head shapes: 32 q / 8 kv heads, head_dim 128; bf16 and fp32), with the split
   counts chosen per step and fixed as under CUDA-graph capture;
3. issue 13's workload on the Llama-3.1-8B config (random bf16 weights): 256 requests = a 2,000-
   token shared prefix + 64 unique random tokens, 128 output tokens (ignore_eos), cascade off
   and on: wall time, output tok/s, prefill time (same shape, another prefix, 1 token) and so
   the decode step, start-up and the cascade graphs' capture time, decode steps that took the
   cascade, bf16 greedy identity and the first decode step's logprob differences;
4. fp32 token identity on the Qwen3-0.6B config: 64 x (512 shared + 32), 32 out, on vs off;
5. the decode attention alone at B=256, prefix 2,000, suffix 64..192, each call replayed from a
   CUDA graph: plain vs cascade, the cascade split into its prefix pass and its suffix pass
   (which merges the prefix's partials itself), against the K/V bytes each must read over the
   copy bandwidth measured here; then a sweep of prefix-kernel configs at suffix 64;
6. the 8B workload again with the sweep's best config, when it beats the default by 5%.

Every engine gets an explicit KV budget and is freed before the next; nothing timed inside a
CUDA graph may sync (checked before capture).

    python scripts/gpu_cascade.py [--quick]

Each section runs in try/except (an error is printed and the next section runs); a table of the
figures is printed last and written to $OUT/gpu_cascade.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

import torch
from gpu_common import sections  # scripts/ is on sys.path when run as a script

from roofline import LLM, SamplingParams
from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import cascade_attention as ca
from roofline.kernels import count_jit_compiles
from roofline.kernels.cascade_attention import cascade_attention, cascade_attention_ref
from roofline.kernels.decode_attention import decode_attention, decode_attention_ref, merge_partials

DEV = torch.device("cuda")
SUMMARY: dict[str, object] = {}
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def _failed(name: str, e: Exception) -> None:
    SUMMARY[f"{name} error"] = f"{type(e).__name__}: {e}"


section = sections(_failed)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def shared_batch(num_reqs: int, prefix_len: int, suffix_lens: list[int], members: list[bool],
                 dtype: torch.dtype, seed: int = 0):  # fmt: skip
    """Random paged K/V where member rows begin with the same prefix pages."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    prefix_pages = prefix_len // PAGE
    own = [-(-s // PAGE) for s in suffix_lens]
    rows = [own[i] + (0 if members[i] else prefix_pages) for i in range(num_reqs)]
    num_pages = prefix_pages + sum(rows)
    shape = (num_pages, PAGE, KV_HEADS, DIM)
    k = torch.randn(shape, device=DEV, generator=gen).to(dtype)
    v = torch.randn(shape, device=DEV, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32).tolist()
    shared = perm[:prefix_pages]
    nxt = prefix_pages
    table = torch.zeros(num_reqs, prefix_pages + max(own), dtype=torch.int32)
    for i in range(num_reqs):
        head = shared if members[i] else perm[nxt : nxt + prefix_pages]
        nxt += 0 if members[i] else prefix_pages
        row = head + perm[nxt : nxt + own[i]]
        nxt += own[i]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    seq_lens = torch.tensor([prefix_len + s for s in suffix_lens], dtype=torch.int32)
    starts = torch.tensor([prefix_len if m else 0 for m in members], dtype=torch.int32)
    q = torch.randn(num_reqs, HEADS, DIM, device=DEV, generator=gen).to(dtype)
    return dict(
        q=q, k_cache=k, v_cache=v, block_table=table.to(DEV), seq_lens=seq_lens.to(DEV),
        prefix_pages=torch.tensor(shared, dtype=torch.int32, device=DEV),
        prefix_len=torch.tensor([prefix_len], dtype=torch.int32, device=DEV),
        suffix_start=starts.to(DEV),
        # host values, so no call below syncs (they run inside CUDA-graph capture)
        max_suffix=max((s - t) for s, t in zip(seq_lens.tolist(), starts.tolist())),
        prefix_host=prefix_len,
        max_seq=int(seq_lens.max()),
    )  # fmt: skip


def run_cascade(b: dict, graph_like: bool = False, block_m: int | None = None) -> torch.Tensor:
    """No host sync (safe inside CUDA-graph capture): bounds come from the batch's host ints."""
    max_suffix, max_prefix = b["max_suffix"], b["prefix_host"]
    if graph_like:  # as the captured graphs call it: bounds from max_model_len
        max_suffix = max_prefix = 8192
    return cascade_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"],
        b["prefix_pages"], b["prefix_len"], b["suffix_start"], DIM**-0.5,
        max_suffix_len=max_suffix, max_prefix_len=max_prefix, block_m=block_m,
    )  # fmt: skip


def run_plain(b: dict) -> torch.Tensor:
    return decode_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"], DIM**-0.5,
        max_seq_len=b["max_seq"],
    )  # fmt: skip


@section("1. parity: cascade vs plain decode kernel vs torch reference")
def parity(quick: bool) -> None:
    rng = random.Random(0)
    n = 24 if quick else 40
    worst = {}
    for dtype in (torch.bfloat16, torch.float32):
        suffix = [rng.randint(1, 192) for _ in range(n)]
        members = [i % 7 != 3 for i in range(n)]  # a few rows outside the group
        b = shared_batch(n, 2000 - 2000 % PAGE, suffix, members, dtype, seed=1)
        ref = cascade_attention_ref(
            b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"],
            b["prefix_pages"], b["prefix_host"], b["suffix_start"], DIM**-0.5,
        )  # fmt: skip
        plain_ref = decode_attention_ref(
            b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"], DIM**-0.5
        )
        for name, out in (
            ("cascade", run_cascade(b)),
            ("cascade(graph splits)", run_cascade(b, graph_like=True)),
            ("cascade(block_m 128)", run_cascade(b, block_m=128)),
            ("plain kernel", run_plain(b)),
            ("torch cascade ref", ref),
        ):
            err = (out.float() - plain_ref.float()).abs().max().item()
            key = f"{str(dtype)[6:]} {name}"
            worst[key] = err
            print(f"  {key:32s} max |diff| vs plain reference = {err:.2e}")
    SUMMARY["parity max err fp32 cascade"] = worst["float32 cascade"]
    SUMMARY["parity max err bf16 cascade"] = worst["bfloat16 cascade"]
    ok = worst["float32 cascade"] < 2e-5 and worst["bfloat16 cascade"] < 2e-2
    SUMMARY["parity ok"] = ok


def graph_time(fn, iters: int = 30) -> float:
    """Median seconds of ``fn`` replayed from a CUDA graph (no host launch overhead). A warm-up
    call runs with sync debugging set to error first: a function that syncs raises there,
    before any capture could leave the device in a failed-capture state."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = time_fn(graph.replay, DEV, iters=iters)
    del graph
    return t


PREFIX_CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 32, 4, 3),
    (128, 64, 4, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 2),
]
BEST: dict[str, object] = {}


@section("5. decode attention at B=256, prefix 2000: plain vs cascade (CUDA-graph timed)")
def kernel_bench(ceil, quick: bool) -> None:
    for suffix_len in (64, 192) if quick else (64, 128, 192):
        _bench_one(ceil, suffix_len, quick)
        free()


def _bench_one(ceil, suffix_len: int, quick: bool) -> None:
    prefix = 2000 - 2000 % PAGE
    scale = DIM**-0.5
    kv_tok = KV_HEADS * DIM * 2 * 2
    b = shared_batch(256, prefix, [suffix_len] * 256, [True] * 256, torch.bfloat16)
    q, kc, vc, table, seq_lens = b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"]
    max_len = prefix + suffix_len
    t_plain = graph_time(
        lambda: decode_attention(q, kc, vc, table, seq_lens, scale, max_seq_len=max_len)
    )
    ca.CONFIG_OVERRIDE = None
    block_m = ca.prefix_block_m(256 * HEADS // KV_HEADS)
    splits = ca.choose_prefix_splits(-(-256 * 4 // block_m) * KV_HEADS, 8192, 132)
    # B=256: one suffix split, so the suffix kernel merges the prefix's slots 0.. itself
    part_out = torch.empty(256, HEADS, splits, DIM, dtype=torch.float32, device=DEV)
    part_lse = torch.empty(256, HEADS, splits, dtype=torch.float32, device=DEV)
    out = torch.empty_like(q)
    args = (q, kc, vc, b["prefix_pages"], b["prefix_len"], b["suffix_start"], scale)
    t_prefix = graph_time(
        lambda: ca.shared_prefix_partials(*args, part_out, part_lse, 0, splits, block_m)
    )
    t_suffix = graph_time(
        lambda: decode_attention(
            q,
            kc,
            vc,
            table,
            seq_lens,
            scale,
            max_seq_len=8192,
            num_splits=1,
            out=out,
            ctx_start=b["suffix_start"],
            partials=(part_out, part_lse),
            merge_prefix=True,
        )  # fmt: skip
    )
    # the unfused merge kernel over the same slots, for comparison
    t_merge = graph_time(lambda: merge_partials(part_out, part_lse, out))
    t_cas = graph_time(lambda: run_cascade(b, graph_like=True))
    bw = ceil.bandwidth_bytes_per_s
    plain_floor = 256 * (prefix + suffix_len) * kv_tok / bw
    cas_floor = (prefix + 256 * suffix_len) * kv_tok / bw
    print(
        f"  suffix {suffix_len:3d}: plain {t_plain * 1e6:6.1f} us (distinct-read floor "
        f"{plain_floor * 1e6:.0f})  cascade {t_cas * 1e6:6.1f} us (floor {cas_floor * 1e6:.0f})"
        f" = prefix {t_prefix * 1e6:.1f} (block_m {block_m}, {splits} splits) + suffix with "
        f"fused merge {t_suffix * 1e6:.1f} (a separate merge kernel would be "
        f"{t_merge * 1e6:.1f}); speed-up {t_plain / t_cas:.2f}x"
    )
    key = f"attn B256 p2000 s{suffix_len}"
    SUMMARY[f"{key} plain us"] = round(t_plain * 1e6, 1)
    SUMMARY[f"{key} cascade us"] = round(t_cas * 1e6, 1)
    SUMMARY[f"{key} prefix/suffix+merge/(unfused merge) us"] = (
        f"{t_prefix * 1e6:.1f}/{t_suffix * 1e6:.1f}/{t_merge * 1e6:.1f}"
    )
    if suffix_len == 64:
        _sweep(b, args, t_cas, PREFIX_CONFIGS[:4] if quick else PREFIX_CONFIGS)


def _sweep(b: dict, args: tuple, t_default: float, configs: list) -> None:
    """The prefix pass over configs (FLOPs: 2 MMAs of [B*G, d] x [d, prefix] per KV head)."""
    flops = 2 * 2 * 256 * HEADS * b["prefix_host"] * DIM
    best = (t_default, None)
    ref = run_plain(b).float()
    for cfg in configs:
        ca.CONFIG_OVERRIDE = cfg
        try:
            sp = ca.choose_prefix_splits(-(-256 * 4 // cfg[0]) * KV_HEADS, 8192, 132)
            po = torch.empty(256, HEADS, 1 + sp, DIM, dtype=torch.float32, device=DEV)
            pl = torch.empty(256, HEADS, 1 + sp, dtype=torch.float32, device=DEV)
            t_p = graph_time(lambda: ca.shared_prefix_partials(*args, po, pl, 1, sp, cfg[0]))  # noqa: B023
            t_c = graph_time(lambda: run_cascade(b, graph_like=True))
            err = (run_cascade(b).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config may not compile
            print(f"    config {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        finally:
            ca.CONFIG_OVERRIDE = None
        print(
            f"    config {cfg}: prefix {t_p * 1e6:6.1f} us ({flops / t_p / 1e12:4.0f} TFLOP/s, "
            f"{sp} splits), cascade {t_c * 1e6:6.1f} us, max |diff| vs plain {err:.1e}"
        )
        if t_c < 0.95 * best[0] and err < 2e-2:
            best = (t_c, cfg)
    BEST["config"] = best[1]
    SUMMARY["prefix config: best of sweep (None: default)"] = f"{best[1]} {best[0] * 1e6:.1f} us"


def workload(num_reqs: int, prefix_len: int, unique: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab - 10) for _ in range(prefix_len)]
    tail = [[rng.randrange(10, vocab - 10) for _ in range(unique)] for _ in range(num_reqs)]
    return [prefix + t for t in tail]


def run_engine(model: str, cascade: bool, prompts, max_tokens: int, prefill_probe=None, **kw):
    """(tokens, wall s, start-up s, cascade steps, members, extras) of one engine's run. The
    engine gets an explicit KV budget (``kv_cache_memory_bytes`` in ``kw``) and is shut down
    and freed before returning, so the next one finds the memory."""
    free()
    from roofline.worker import cascade_graphs

    capture_s = []
    orig_capture = cascade_graphs.CascadeDecodeGraphs.capture

    def timed_capture(self, pool=None):
        t = time.perf_counter()
        orig_capture(self, pool)
        capture_s.append(time.perf_counter() - t)

    cascade_graphs.CascadeDecodeGraphs.capture = timed_capture
    t0 = time.perf_counter()
    try:
        llm = LLM(model, load_format="dummy", device="cuda", cascade_attention=cascade, **kw)
    finally:
        cascade_graphs.CascadeDecodeGraphs.capture = orig_capture
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    used = []
    if runner.cascade is not None:
        plan = runner.cascade.plan
        runner.cascade.plan = lambda s: used.append(plan(s)) or used[-1]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = workload(8, 300, 16, 300, seed=99)  # another prefix: nothing of it is reused
    llm.generate([{"prompt_token_ids": p} for p in warm], greedy, use_tqdm=False)
    used.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with count_jit_compiles() as compiled:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if compiled:
        print(f"  JIT compiles during the timed run: {sorted(set(compiled))}")
    tokens = [o.outputs[0].token_ids for o in outs]
    steps = sum(p is not None for p in used)
    members = max((p.num_members for p in used if p is not None), default=0)
    extras = {"capture_s": sum(capture_s)}
    if prefill_probe is not None:  # same shape, another prefix: prefill + 1 token
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prefill_probe], one, use_tqdm=False)
        torch.cuda.synchronize()
        extras["prefill_s"] = time.perf_counter() - t0
        lp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], lp, use_tqdm=False)
        extras["logprobs"] = [o.outputs[0].logprobs for o in outs]
    llm.llm_engine.shutdown()
    del llm, runner, outs
    free()
    return tokens, wall, startup, steps, members, extras


def _first_decode_logprob_diff(a, b) -> tuple[float, int]:
    """Max |logprob diff| over the tokens both runs list at the first decode step, and the
    requests whose top token differs there."""
    worst, flips = 0.0, 0
    for la, lb in zip(a, b):
        da, db = la[1], lb[1]
        for tok in set(da) & set(db):
            worst = max(worst, abs(da[tok].logprob - db[tok].logprob))
        top_a = min(da, key=lambda t: da[t].rank)
        top_b = min(db, key=lambda t: db[t].rank)
        flips += top_a != top_b
    return worst, flips


E2E: dict[str, tuple] = {}
PROMPTS_8B = workload(256, 2000, 64, 128000)
PROBE_8B = workload(256, 2000, 64, 128000, seed=7)
KV_8B = 16 << 30  # 131k tokens: the shared prefix, 256 suffixes, the probe's prefix and more


def e2e_run(tag: str, cascade: bool, cfg=None) -> None:
    ca.CONFIG_OVERRIDE = cfg
    try:
        tokens, wall, startup, steps, members, ext = run_engine(
            "llama-3.1-8b", cascade, PROMPTS_8B, 128, prefill_probe=PROBE_8B,
            max_model_len=2304, max_num_seqs=256, kv_cache_memory_bytes=KV_8B,
        )  # fmt: skip
    finally:
        ca.CONFIG_OVERRIDE = None
    out_tps = 256 * 128 / wall
    E2E[tag] = (tokens, ext)
    decode_ms = (wall - ext["prefill_s"]) / 127 * 1e3
    print(f"  cascade {tag:9s}: wall {wall:.2f} s, {out_tps:,.0f} output tok/s; prefill + 1 "
          f"token {ext['prefill_s']:.2f} s, so ~{decode_ms:.1f} ms per decode step; start-up "
          f"{startup:.1f} s (cascade graph capture {ext['capture_s']:.1f} s); cascade steps "
          f"{steps} (members up to {members})", flush=True)  # fmt: skip
    SUMMARY[f"8B shared-prefix wall s (cascade {tag})"] = round(wall, 3)
    SUMMARY[f"8B shared-prefix output tok/s (cascade {tag})"] = round(out_tps)
    SUMMARY[f"8B decode step ms (cascade {tag})"] = round(decode_ms, 2)
    SUMMARY[f"8B start-up s (cascade {tag})"] = round(startup, 1)
    if cascade:
        SUMMARY[f"8B cascade decode steps ({tag})"] = steps
        SUMMARY[f"8B cascade graph capture s ({tag})"] = round(ext["capture_s"], 2)
    off = SUMMARY.get("8B shared-prefix wall s (cascade off)")
    if cascade and off:
        SUMMARY[f"8B speed-up off/{tag}"] = round(off / wall, 3)


@section("3. issue 13 workload: Llama-3.1-8B, 256 x (2000 shared + 64), 128 out: off, on")
def e2e() -> None:
    e2e_run("off", False)
    e2e_run("on", True)
    (off, ext_off), (on, ext_on) = E2E["off"], E2E["on"]
    same = sum(a == b for a, b in zip(off, on))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(off, on)]  # fmt: skip
    SUMMARY["8B bf16 greedy identical requests"] = f"{same}/256"
    SUMMARY["8B bf16 mean first differing token"] = round(sum(first_diff) / len(first_diff), 1)
    worst, flips = _first_decode_logprob_diff(ext_off["logprobs"], ext_on["logprobs"])
    SUMMARY["8B bf16 first decode step: max |logprob diff| on/off"] = round(worst, 4)
    SUMMARY["8B bf16 first decode step: top token differs"] = f"{flips}/32"
    print(f"  bf16 greedy identical: {same}/256 (mean first difference at token "
          f"{SUMMARY['8B bf16 mean first differing token']}); first decode step: max |logprob "
          f"diff| {worst:.4f}, top token differs in {flips}/32")  # fmt: skip


@section("6. the 8B workload again with the sweep's best prefix config")
def e2e_tuned() -> None:
    if BEST.get("config") is None:
        print("  the default config was within 5% of the best: nothing to rerun")
        return
    e2e_run("on, tuned", True, BEST["config"])


@section("4. fp32 token identity: Qwen3-0.6B config, 64 x (512 shared + 32), 32 out")
def fp32_identity() -> None:
    prompts = workload(64, 512, 32, 150000, seed=3)
    res = {}
    for cascade in (False, True):
        tokens, wall, _, steps, _, _ = run_engine(
            "qwen3-0.6b", cascade, prompts, 32, dtype="float32", max_model_len=640,
            max_num_seqs=64, kv_cache_memory_bytes=8 << 30,
        )  # fmt: skip
        res[cascade] = tokens
        print(f"  cascade {cascade}: wall {wall:.2f} s, cascade steps {steps}")
        if cascade:
            SUMMARY["qwen3-0.6b fp32 cascade steps"] = steps
    same = sum(a == b for a, b in zip(res[False], res[True]))
    SUMMARY["qwen3-0.6b fp32 greedy identical"] = f"{same}/64"
    print(f"  fp32 greedy identical: {same}/64")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the < 90 s subset")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"{ceil.device_name}: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy TB/s"] = round(ceil.bandwidth_bytes_per_s / 1e12, 2)
    parity(args.quick)
    e2e()
    fp32_identity()
    kernel_bench(ceil, args.quick)
    e2e_tuned()
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    for key, value in SUMMARY.items():
        print(f"  {key:48s} {value}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_cascade.json"), "w") as f:
            json.dump(SUMMARY, f, indent=1)


if __name__ == "__main__":
    main()
