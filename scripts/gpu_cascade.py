"""Cascade (shared-prefix) decode attention on the GPU, in one process (< 4 min on one H100;
``--quick`` < 90 s):

1. parity of ``cascade_attention`` against the plain decode kernel and the torch reference
   (Llama-3.1-8B head shapes: 32 q / 8 kv heads, head_dim 128; bf16 and fp32), with the split
   counts chosen per step and fixed as under CUDA-graph capture;
2. the decode attention alone at B=256, prefix 2,000, suffix 64..192: plain vs cascade (us, and
   the K/V bytes each must read over the copy bandwidth measured here);
3. issue 13's workload on the Llama-3.1-8B config (random bf16 weights): 256 requests = a 2,000-
   token shared prefix + 64 unique random tokens, 128 output tokens (ignore_eos), cascade on vs
   off: wall time, output tok/s, decode steps that took the cascade, and greedy token identity;
4. (full run) fp32 token identity on the Qwen3-0.6B config (64 requests of the same shape, 32
   output tokens), cascade on vs off.

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
import traceback

import torch

from roofline import LLM, SamplingParams
from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import count_jit_compiles
from roofline.kernels.cascade_attention import cascade_attention, cascade_attention_ref
from roofline.kernels.decode_attention import decode_attention, decode_attention_ref

DEV = torch.device("cuda")
SUMMARY: dict[str, object] = {}
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                SUMMARY[f"{name} error"] = f"{type(e).__name__}: {e}"
            print(f"({time.perf_counter() - t0:.1f} s)", flush=True)

        return run

    return wrap


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
    )  # fmt: skip


def run_cascade(b: dict, graph_like: bool = False, block_m: int | None = None) -> torch.Tensor:
    max_suffix = int((b["seq_lens"] - b["suffix_start"]).max())
    kw = {}
    if graph_like:  # as the captured graphs call it: bounds from max_model_len
        max_suffix = 8192
        kw = dict(max_prefix_len=8192)
    return cascade_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"],
        b["prefix_pages"], b["prefix_len"], b["suffix_start"], DIM**-0.5,
        max_suffix_len=max_suffix, max_prefix_len=kw.get("max_prefix_len", int(b["prefix_len"])),
        block_m=block_m,
    )  # fmt: skip


def run_plain(b: dict) -> torch.Tensor:
    return decode_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"], DIM**-0.5,
        max_seq_len=int(b["seq_lens"].max()),
    )  # fmt: skip


@section("1. parity: cascade vs plain decode kernel vs torch reference")
def parity(quick: bool) -> None:
    rng = random.Random(0)
    n = 24 if quick else 64
    worst = {}
    for dtype in (torch.bfloat16, torch.float32):
        suffix = [rng.randint(1, 192) for _ in range(n)]
        members = [i % 7 != 3 for i in range(n)]  # a few rows outside the group
        b = shared_batch(n, 2000 - 2000 % PAGE, suffix, members, dtype, seed=1)
        ref = cascade_attention_ref(
            b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["seq_lens"],
            b["prefix_pages"], int(b["prefix_len"]), b["suffix_start"], DIM**-0.5,
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


@section("2. decode attention at B=256, prefix 2000: plain vs cascade")
def kernel_bench(ceil, quick: bool) -> None:
    bw = ceil.bandwidth_bytes_per_s
    prefix = 2000 - 2000 % PAGE
    for suffix_len in (64,) if quick else (64, 128, 192):
        b = shared_batch(256, prefix, [suffix_len] * 256, [True] * 256, torch.bfloat16)
        t_plain = time_fn(lambda b=b: run_plain(b), DEV, iters=20)
        t_cas = time_fn(lambda b=b: run_cascade(b), DEV, iters=20)
        t_cg = time_fn(lambda b=b: run_cascade(b, graph_like=True), DEV, iters=20)
        t_m128 = time_fn(lambda b=b: run_cascade(b, block_m=128), DEV, iters=20)
        kv_tok = KV_HEADS * DIM * 2 * 2
        plain_floor = 256 * (prefix + suffix_len) * kv_tok / bw
        cas_floor = (prefix + 256 * suffix_len) * kv_tok / bw
        print(
            f"  suffix {suffix_len:3d}: plain {t_plain * 1e6:7.1f} us (distinct-read floor "
            f"{plain_floor * 1e6:.0f} us)  cascade {t_cas * 1e6:6.1f} us (graph splits "
            f"{t_cg * 1e6:6.1f}, block_m 128 {t_m128 * 1e6:6.1f}; floor {cas_floor * 1e6:.0f} "
            f"us)  speed-up {t_plain / t_cas:.2f}x"
        )
        SUMMARY[f"attn B256 p2000 s{suffix_len} plain us"] = round(t_plain * 1e6, 1)
        SUMMARY[f"attn B256 p2000 s{suffix_len} cascade us"] = round(t_cas * 1e6, 1)
        SUMMARY[f"attn B256 p2000 s{suffix_len} cascade bm128 us"] = round(t_m128 * 1e6, 1)
        del b
        free()


def workload(num_reqs: int, prefix_len: int, unique: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab - 10) for _ in range(prefix_len)]
    tail = [[rng.randrange(10, vocab - 10) for _ in range(unique)] for _ in range(num_reqs)]
    return [prefix + t for t in tail]


def run_engine(model: str, cascade: bool, prompts, max_tokens: int, **kw):
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", cascade_attention=cascade, **kw)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    used = []
    if runner.cascade is not None:
        plan = runner.cascade.plan
        runner.cascade.plan = lambda s: used.append(plan(s)) or used[-1]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = workload(8, 300, 16, 1000, seed=99)  # another prefix: nothing of it is reused
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
    del llm, runner
    free()
    return tokens, wall, startup, steps, members


@section("3. issue 13 workload: Llama-3.1-8B, 256 x (2000 shared + 64), 128 out")
def e2e(quick: bool) -> None:
    prompts = workload(256, 2000, 64, 128000)
    res = {}
    for cascade in (False, True):
        tokens, wall, startup, steps, members = run_engine(
            "llama-3.1-8b", cascade, prompts, 128, max_model_len=2304, max_num_seqs=256
        )
        out_tps = 256 * 128 / wall
        tag = "on" if cascade else "off"
        res[tag] = tokens
        print(f"  cascade {tag:3s}: wall {wall:.2f} s, {out_tps:,.0f} output tok/s, start-up "
              f"{startup:.1f} s, cascade steps {steps} (members up to {members})")  # fmt: skip
        SUMMARY[f"8B shared-prefix wall s (cascade {tag})"] = round(wall, 3)
        SUMMARY[f"8B shared-prefix output tok/s (cascade {tag})"] = round(out_tps)
        SUMMARY[f"8B start-up s (cascade {tag})"] = round(startup, 1)
        if cascade:
            SUMMARY["8B cascade decode steps"] = steps
    same = sum(a == b for a, b in zip(res["off"], res["on"]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(res["off"], res["on"])]  # fmt: skip
    SUMMARY["8B speed-up (off/on wall)"] = round(
        SUMMARY["8B shared-prefix wall s (cascade off)"]
        / SUMMARY["8B shared-prefix wall s (cascade on)"], 3,
    )  # fmt: skip
    SUMMARY["8B bf16 greedy identical requests"] = f"{same}/256"
    SUMMARY["8B bf16 mean first differing token"] = round(sum(first_diff) / len(first_diff), 1)
    print(f"  bf16 greedy identical: {same}/256 (mean first difference at token "
          f"{SUMMARY['8B bf16 mean first differing token']})")  # fmt: skip


@section("4. fp32 token identity: Qwen3-0.6B config, 64 x (2000 shared + 64), 32 out")
def fp32_identity() -> None:
    prompts = workload(64, 2000, 64, 150000, seed=3)
    res = {}
    for cascade in (False, True):
        tokens, wall, _, steps, _ = run_engine(
            "qwen3-0.6b", cascade, prompts, 32, dtype="float32", max_model_len=2304,
            max_num_seqs=64,
        )  # fmt: skip
        res[cascade] = tokens
        print(f"  cascade {cascade}: wall {wall:.2f} s, cascade steps {steps}")
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
    kernel_bench(ceil, args.quick)
    e2e(args.quick)
    if not args.quick:
        fp32_identity()
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    for key, value in SUMMARY.items():
        print(f"  {key:48s} {value}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_cascade.json"), "w") as f:
            json.dump(SUMMARY, f, indent=1)


if __name__ == "__main__":
    main()
