"""Issue 13: long fresh prompts through torch SDPA's cuDNN backend (``attention/sdpa_prefill.py``)
on the H100: parity, attention alone, the whole Llama-3.1-8B, presets, start-up, decode.

1. parity: the backend with the path on vs off (our kernels) vs the fp32 reference (1k, 8k
   fresh; a ragged batch with short and chunked prompts, two long fresh ones (in place, copied)
   and a long chunk over a short prefix; the split backend decode-first);
2. attention alone per layer at 1024 .. 16384 tokens (32/8 heads, d 128, model layout): ours vs
   cuDNN at the exact length and at a length off the buckets (padded in place / by a copy), with
   TFLOP/s; a 2048 chunk over 8192 cached: ours vs two cuDNN calls merged by their LSE (private
   op, an experiment: torch's cuDNN path has no bottom-right causal mask);
3. the cost of cuDNN's first call at a new length (its graph build);
4. the 8192-token prefill through the whole model with the path on and off (% of the matmul
   ceiling measured in this run, as gpu_prefill.py computes it), an 8000-token prompt (a padded
   bucket), a 7808-token chunk over 192 cached (a window with its prefix: the long-prompt
   preset's second chunks), the 2048 chunk over 8k (stays ours), a kernel profile;
5. the long-prompt and default presets on and off;
6. in a FRESH process with the path on: start-up with the bucket warm-up, the default and
   long-prompt presets' first runs (JIT compiles), 8B batch-1 decode at --max-model-len 8448.
Sections 4-6 live in ``gpu_sdpa_model.py``.

A decision table last.   python scripts/gpu_sdpa.py [--dry-run]   (--dry-run: CPU, tiny shapes,
SDPA's math backend and the Triton interpreter; the model sections only import their pieces)
"""

from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv or "--dry" in sys.argv
os.environ.setdefault("ROOFLINE_SDPA_PREFILL", "1")  # before roofline: the warm-up's buckets
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import gpu_prefill as gp  # noqa: E402
import gpu_sdpa_model as gm  # noqa: E402
import torch  # noqa: E402
from gpu_startup_prefill import SUMMARY, section  # noqa: E402

from roofline.attention import sdpa_prefill as sp  # noqa: E402
from roofline.bench.ceilings import measure, time_fn  # noqa: E402
from roofline.kernels.prefill_attention import (  # noqa: E402
    causal_attention_flops,
    prefill_attention,
    prefill_attention_ref,
)

DEV = torch.device("cpu" if DRY else "cuda")
gp.DEV = DEV  # gpu_prefill's helpers (model_layout) on this device
H, HK, D = (8, 2, 32) if DRY else (32, 8, 128)
gp.H, gp.HK, gp.D = H, HK, D
PS, SCALE, DT = 16, D**-0.5, torch.bfloat16
DIV = 64 if DRY else 1  # dry run: every length / 64
LENGTHS = [n // DIV for n in ((1024, 2048, 4096) if DRY else (1024, 2048, 4096, 8192, 16384))]
ITERS, WARM = (1, 0) if DRY else (10, 3)
if DRY:  # tiny buckets for tiny lengths
    sp.MIN_GRANULE, sp.BUCKETS_PER_OCTAVE = 8, 4


def tflops(n_new: int, n_ctx: int, seconds: float) -> float:
    return causal_attention_flops([n_new + n_ctx], [n_new], H, D) / seconds / 1e12


def step(query_lens: list[int], ctx: list[int]):  # noqa: ANN202
    """A step's q/k/v (views of one QKV row per token, as the model passes them), its paged
    cache (every position already stored), metadata and the fp32 paged reference."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from kernel_utils import make_paged

    from roofline.attention.metadata import AttentionMetadata

    b = make_paged(query_lens, ctx, H, HK, D, PS, DT, seed=sum(query_lens))
    k = torch.cat([ks[c:] for ks, c in zip(b.k_seqs, ctx, strict=True)])
    v = torch.cat([vs[c:] for vs, c in zip(b.v_seqs, ctx, strict=True)])
    t = k.shape[0]
    qkv = torch.cat([b.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    q, k, v = sp.split_rows(qkv, H, HK, D)  # [t, H, D], [t, Hk, D] x 2: views of qkv
    meta = AttentionMetadata(
        num_reqs=len(query_lens), num_tokens=t, query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens, block_table=b.block_table, slot_mapping=b.slot_mapping,
        max_query_len=max(query_lens), max_seq_len=max(b.seq_lens_list), page_size=PS,
        query_start_loc_cpu=b.query_start_loc.tolist(), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(b.seq_lens_list),
    )  # fmt: skip
    ref = prefill_attention_ref(q, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                                b.seq_lens, SCALE)  # fmt: skip
    return q, k, v, b, meta, ref


def backends(min_len: int):  # noqa: ANN201
    """(path on, path off) Triton backends."""
    from roofline.attention.triton_backend import TritonAttentionBackend

    on, off = TritonAttentionBackend(), TritonAttentionBackend()
    on.sdpa_prefill = sp.SdpaPrefill(min_query_len=min_len, enabled=True)
    off.sdpa_prefill = sp.SdpaPrefill(enabled=False)
    return on, off


def check(label: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 3e-2) -> bool:
    err = (got.float() - ref.float()).abs().max().item()
    print(f"  {label}: max abs diff {err:.3g} {'ok' if err < tol else 'MISMATCH'}", flush=True)
    return err < tol


@section("1. parity: path on vs off (our kernels) vs the fp32 reference")
def parity() -> None:
    from roofline.worker.host_batch import HostBatch
    from roofline.worker.mixed_graph import eager_split_metadata

    on, off = backends(1024 // DIV)  # every fresh prompt of >= 1k tokens to SDPA
    cases = {  # (query lens, cached lens): every fresh request >= 1k goes to SDPA
        "1k fresh": ([1024 // DIV], [0]),
        "ragged: decode, 300, 2500 (in place), 1000 over 1500 (ours), 3000 over 500 (window "
        "with its prefix), 3000 (padded copy)": (
            [1, 300 // DIV, 2500 // DIV, 1000 // DIV, 3000 // DIV, 3000 // DIV],
            [40, 0, 0, 1500 // DIV, 500 // DIV, 0],
        ),
    }
    steps = []  # (label, forward(backend) -> out, reference)
    for label, (lens, ctx) in cases.items():
        q, k, v, b, meta, ref = step(lens, ctx)
        plan = on.sdpa_prefill.plan(q, meta, False)
        print(f"  {label}: segments {[tuple(s) for s in plan.segments]}", flush=True)
        steps.append((label, functools.partial(_fwd, q, k, v, b.k_cache, b.v_cache, meta), ref))
    n = 8192 // DIV
    q, k, v, kc, vc, bt, qsl, sl = gp.model_layout(n)
    if DRY:  # (flash is CUDA only)
        ref = sp.causal_sdpa(q.float(), k.float(), v.float(), SCALE)
    else:
        ref = gp.sdpa_ref(q, k, v)
    fwd8k = functools.partial(_fwd, q, k, v, kc, vc, _meta(n, qsl, sl, bt))
    steps.append(("8k fresh (whole step)", fwd8k, ref))
    # decode-first split step: 2 decodes, a long fresh, a short chunk, a long fresh last
    lens, ctx = [1, 1, 2500 // DIV, 5, 2048 // DIV], [40, 17, 0, 3, 0]
    q, k, v, b, meta, ref = step(lens, ctx)
    host = HostBatch(PS)
    for n_new, s in zip(lens, b.seq_lens_list, strict=True):
        host.input_ids.extend([0] * n_new)
        host.query_start.append(host.query_start[-1] + n_new)
        host.seq_lens.append(s)
    i64 = functools.partial(torch.tensor, dtype=torch.int64, device=DEV)
    split = eager_split_metadata(host, 2, i64(host.query_start), i64(host.seq_lens),
                                 b.slot_mapping, b.block_table[:2].clone(),
                                 b.block_table[2:].clone())  # fmt: skip
    fwd_split = functools.partial(_fwd, q, k, v, b.k_cache, b.v_cache, split, split=True)
    steps.append(("split decode-first", fwd_split, ref))
    if not DRY:  # our kernels' variants compiled on a thread pool first
        gp.compile_all([functools.partial(f, backend=bk) for _, f, _ in steps for bk in (on, off)])
    ok = []
    for label, f, ref in steps:
        got_on, got_off = f(backend=on), f(backend=off)
        ok += [check(f"{label}, path on vs ref", got_on, ref),
               check(f"{label}, path off vs ref", got_off, ref),
               check(f"{label}, on vs off", got_on, got_off)]  # fmt: skip
    SUMMARY.append(("parity", f"{sum(ok)} of {len(ok)} ok"))


def _fwd(q, k, v, kc, vc, meta, backend, split: bool = False) -> torch.Tensor:  # noqa: ANN001
    from roofline.attention.split_backend import SplitAttentionBackend

    bk = SplitAttentionBackend(backend) if split else backend
    return bk.forward(q, k, v, kc, vc, meta, SCALE)


def _meta(n: int, qsl, sl, bt):  # noqa: ANN001, ANN202
    from roofline.attention.metadata import AttentionMetadata

    return AttentionMetadata(
        num_reqs=1, num_tokens=n, query_start_loc=qsl, seq_lens=sl, block_table=bt,
        slot_mapping=torch.arange(n, device=DEV), max_query_len=n, max_seq_len=n, page_size=PS,
        query_start_loc_cpu=[0, n], query_lens_cpu=[n], seq_lens_cpu=[n],
    )  # fmt: skip


def layer_row(n: int) -> dict[str, float]:
    """Seconds of one layer's attention over an ``n``-token fresh prompt (model layout): ours,
    cuDNN exact; at ``m`` tokens just past a bucket boundary: ours, the strategy's segment
    padded in place (the rows after it exist) and by a copy (they do not), output copied."""
    q, k, v, kc, vc, bt, qsl, sl = gp.model_layout(n)
    ours = functools.partial(prefill_attention, q, kc, vc, bt, qsl, sl, SCALE, n, k_new=k,
                             v_new=v, has_prefix=False)  # fmt: skip
    row = {"ours": time_fn(ours, DEV, ITERS, WARM)}
    row["cudnn"] = time_fn(functools.partial(sp.causal_sdpa, q, k, v, SCALE), DEV, ITERS, WARM)
    m = n - max(n // 16, sp.MIN_GRANULE) + 1  # just past a bucket: the most padding
    qsl_m = torch.tensor([0, m], device=DEV, dtype=torch.int32)
    sl_m = torch.tensor([m], device=DEV, dtype=torch.int32)
    ours_m = functools.partial(prefill_attention, q[:m], kc, vc, bt, qsl_m, sl_m, SCALE, m,
                               k_new=k[:m], v_new=v[:m], has_prefix=False)  # fmt: skip
    out = torch.empty_like(q[:m])
    seg = sp.Segment(0, 0, m, sp.bucket_len(m))

    def padded(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> None:
        out.copy_(sp.attend_segment(seg, qq, kk, vv, SCALE)[:m])

    row["ours_m"] = time_fn(ours_m, DEV, ITERS, WARM)
    row["in_place"] = time_fn(functools.partial(padded, q, k, v), DEV, ITERS, WARM)
    row["copy"] = time_fn(functools.partial(padded, q[:m], k[:m], v[:m]), DEV, ITERS, WARM)
    return row | {"m": m}


@section("2. attention alone per layer: ours vs cuDNN (exact, padded in place, padded copy)")
def per_layer() -> dict[int, dict[str, float]]:
    table: dict[int, dict[str, float]] = {}
    print(f"  {'tokens':>6} {'ours':>16} {'cuDNN exact':>16} {'off-bucket n':>12} "
          f"{'ours':>16} {'in place':>16} {'copy':>16}", flush=True)  # fmt: skip
    for n in LENGTHS:
        row = layer_row(n)
        m = row["m"]
        table[n] = row
        cells = [f"{row[c] * 1e3:7.3f} ms {tflops(n, 0, row[c]):4.0f}" for c in ("ours", "cudnn")]
        cells += [f"{m:>12}"] + [f"{row[c] * 1e3:7.3f} ms {tflops(m, 0, row[c]):4.0f}"
                                 for c in ("ours_m", "in_place", "copy")]  # fmt: skip
        print(f"  {n:>6} " + " ".join(f"{c:>16}" for c in cells), flush=True)
        SUMMARY.append((f"attention {n}: ours / cuDNN (TF/s)",
                        f"{tflops(n, 0, row['ours']):.0f} / {tflops(n, 0, row['cudnn']):.0f}; "
                        f"off-bucket {m}: ours {tflops(m, 0, row['ours_m']):.0f}, padded in "
                        f"place {tflops(m, 0, row['in_place']):.0f}, copy "
                        f"{tflops(m, 0, row['copy']):.0f}"))  # fmt: skip
    for n, ctx in ((7808 // DIV, 192 // DIV), (6144 // DIV, 2048 // DIV)):
        t_ours, t_win = prefix_window_row(n, ctx)
        print(f"  {n} over {ctx} cached: ours (prefix gathered) {t_ours * 1e3:.3f} ms "
              f"{tflops(n, ctx, t_ours):.0f} TF/s, cuDNN window (prefix copied in) "
              f"{t_win * 1e3:.3f} ms {tflops(n, ctx, t_win):.0f} TF/s", flush=True)  # fmt: skip
        SUMMARY.append((f"attention {n} over {ctx}: ours / cuDNN window (TF/s)",
                        f"{tflops(n, ctx, t_ours):.0f} / {tflops(n, ctx, t_win):.0f}"))  # fmt: skip
    if not DRY:
        try:
            chunk_over_prefix()
        except Exception as e:  # noqa: BLE001 - an experiment: report and go on
            print(f"  chunk over prefix (cuDNN merged): {type(e).__name__}: {str(e)[:300]}")
    return table


def prefix_window_row(n: int, ctx: int) -> tuple[float, float]:
    """Seconds of one layer's attention for an ``n``-row chunk over ``ctx`` cached tokens:
    ours (the prefix gathered, as the backend runs it) and the strategy's window."""
    from roofline.kernels.prefix_gather import gather_prefix, plan_prefix

    q, k, v, kc, vc, bt, qsl, sl = gp.model_layout(ctx + n)  # pages in order, all cached
    qc, kn, vn = q[ctx:], k[ctx:], v[ctx:]
    qsl2 = torch.tensor([0, n], device=DEV, dtype=torch.int32)
    plan = plan_prefix(bt, [ctx + n], [n], PS)
    pref = None if plan is None else gather_prefix(plan, kc, vc)
    ours = functools.partial(prefill_attention, qc, kc, vc, bt, qsl2, sl, SCALE, n, k_new=kn,
                             v_new=vn, prefix=pref)  # fmt: skip
    seg = sp.Segment(0, 0, n, sp.bucket_len(ctx + n), ctx)
    out = torch.empty_like(qc)

    def window() -> None:
        pre = sp.cached_prefix(seg, kc, vc, bt)
        out.copy_(sp.attend_segment(seg, qc, kn, vn, SCALE, pre)[ctx : ctx + n])

    window()
    check(f"{n} over {ctx}: cuDNN window vs ours", out, ours())
    return time_fn(ours, DEV, ITERS, WARM), time_fn(window, DEV, ITERS, WARM)


def chunk_over_prefix() -> None:
    """2048 over 8192 cached: ours (prefix gathered) vs cuDNN prefix (non-causal) + chunk
    (causal) merged by their log-sum-exps (the private op returns them)."""
    from roofline.kernels.prefix_gather import gather_prefix, plan_prefix

    ctx, m = 8192, 2048
    q, k, v, kc, vc, bt, qsl, sl = gp.model_layout(ctx + m)  # pages in order, all cached
    qc, kn, vn = q[ctx:], k[ctx:], v[ctx:]
    qsl2 = torch.tensor([0, m], device=DEV, dtype=torch.int32)
    pref = gather_prefix(plan_prefix(bt, [ctx + m], [m], PS), kc, vc)
    ours = functools.partial(prefill_attention, qc, kc, vc, bt, qsl2, sl, SCALE, m, k_new=kn,
                             v_new=vn, prefix=pref)  # fmt: skip
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    heads = lambda t: t.transpose(0, 1)[None]  # noqa: E731

    def merged() -> torch.Tensor:
        o1, l1 = op(heads(qc), heads(k[:ctx]), heads(v[:ctx]), None, True, 0.0, False, False,
                    scale=SCALE)[:2]  # fmt: skip
        o2, l2 = op(heads(qc), heads(kn), heads(vn), None, True, 0.0, True, False,
                    scale=SCALE)[:2]  # fmt: skip
        l1, l2 = (x.reshape(o1.shape[:-1]).unsqueeze(-1) for x in (l1, l2))  # [1, H, m, 1]
        top = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
        return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(qc.dtype)[0].transpose(0, 1)

    base = ours()
    check("2048 over 8k: cuDNN prefix + chunk merged vs ours", merged(), base)
    t_ours, t_merged = time_fn(ours, DEV, ITERS, WARM), time_fn(merged, DEV, ITERS, WARM)
    print(
        f"  2048 over 8k: ours {t_ours * 1e6:.0f} us {tflops(m, ctx, t_ours):.0f} TF/s, "
        f"cuDNN merged {t_merged * 1e6:.0f} us {tflops(m, ctx, t_merged):.0f} TF/s",
        flush=True,
    )
    SUMMARY.append(("chunk 2048 over 8k: ours / cuDNN merged (TF/s)",
                    f"{tflops(m, ctx, t_ours):.0f} / {tflops(m, ctx, t_merged):.0f}"))  # fmt: skip


def two_calls(n: int) -> list[float]:
    """Seconds of two consecutive cuDNN calls at ``n`` tokens (the model's row layout)."""
    args = sp.split_rows(torch.zeros(n, (H + 2 * HK) * D, device=DEV, dtype=DT), H, HK, D)
    times = []
    for _ in range(2):
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sp.causal_sdpa(*args, SCALE)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


@section("3. cuDNN's first call at a new length (its graph build) vs the next; another thread")
def first_call() -> None:
    import threading

    for n in [x // DIV for x in (3000, 5000, 7000)]:
        times = two_calls(n)
        print(f"  {n} tokens: first call {times[0] * 1e3:.1f} ms, second {times[1] * 1e3:.2f} ms",
              flush=True)  # fmt: skip
        SUMMARY.append((f"cuDNN first call at {n}", f"{times[0] * 1e3:.1f} ms (next "
                        f"{times[1] * 1e3:.2f})"))  # fmt: skip
    other: list[list[float]] = []  # the same shape again, on a new thread (graphs per thread?)
    t = threading.Thread(target=lambda: other.append(two_calls(3000 // DIV)))
    t.start()
    t.join()
    if other:
        print(f"  3000 tokens again on a new thread: first call {other[0][0] * 1e3:.1f} ms, "
              f"second {other[0][1] * 1e3:.2f} ms", flush=True)  # fmt: skip
        SUMMARY.append(("cuDNN 3000 on a new thread", f"{other[0][0] * 1e3:.1f} ms first call"))


def decisions(layer: dict, model: dict, pre: dict) -> None:
    print("\n=== decision table")
    wins = [n for n, r in sorted(layer.items()) if min(r["in_place"], r["copy"]) < r["ours_m"]]
    threshold = wins[0] if wins else None
    print(
        f"  per layer: cuDNN (padded) beats ours from {threshold} tokens up "
        f"-> ROOFLINE_SDPA_MIN_LEN={threshold if threshold else 'keep the path off'}"
    )
    for key in ("8192", "8000", "7808/192"):
        if f"{key} on" in model:
            print(
                f"  whole model {key}: path on {model[key + ' on']:.1f}% vs off "
                f"{model[key + ' off']:.1f}% of matmul (goal >= 80%)"
            )
    for name in ("long-prompt", "default"):
        if f"{name} on" in pre:
            print(
                f"  preset {name}: on {pre[name + ' on']:.1f}% vs off {pre[name + ' off']:.1f}%"
                " of roofline (goal: default >= 80, long-prompt >= 70, no loss)"
            )
    print(
        "  ship (ENABLED default 1) if: 8192 on >= 80% and > off, presets not lower, decode "
        ">= 169 tok/s, start-up < 15 s (section 6), 0 JIT compiles in the fresh runs"
    )


def main() -> None:
    if "--child" in sys.argv:
        gm.child(DRY)
        return
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s; path env "
          f"{os.environ.get('ROOFLINE_SDPA_PREFILL')}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}", flush=True)  # fmt: skip
    parity()
    layer = per_layer() or {}
    first_call()
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    llm = None
    if not DRY:
        from roofline import LLM

        t1 = time.perf_counter()
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **gp.ENGINE_KW)
        SUMMARY.append(("engine start-up (path on, this process)",
                        f"{time.perf_counter() - t1:.1f} s"))  # fmt: skip
    model = gm.model_prefill(llm, ceil) or {}
    pre = gm.presets(llm, ceil) or {}
    del llm
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    gm.fresh_process(__file__, DRY)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    width = max(len(n) for n, _ in SUMMARY)
    for name, value in SUMMARY:
        print(f"{name.rjust(width)}: {value}")
    decisions(layer, model, pre)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_sdpa.json"), "w") as f:
        json.dump(dict(SUMMARY), f, indent=1)


if __name__ == "__main__":
    main()
