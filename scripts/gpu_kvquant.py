"""The quantized KV cache on the GPU, in one process (< 4 min on one H100):

1. parity of the fp8 / int8 store, fused RoPE + store, decode and prefill attention kernels
   against their torch references (Llama-3.1-8B head shapes, bf16);
2. the decode attention kernel alone at batch 32 x 8k context: bf16 vs fp8 vs int8 pages, in
   GB/s of K/V (+ scales) read against the copy bandwidth measured here;
3. Llama-3.1-8B (random weights) decode step at batch 32 with 8k-token contexts, bf16 KV vs fp8
   KV (goal: fp8 >= 1.3x), each beside its roofline (weight bytes + KV bytes, scales included,
   over the copy bandwidth);
4. the offline workload (256 requests, input 100-1024, output 512) at a fixed KV budget: peak
   running requests, preemptions and throughput with auto vs fp8 KV, and fp8-KV greedy
   agreement with bf16 KV on the same random weights (first tokens of 16 prompts).

    python scripts/gpu_kvquant.py [--kv-budget-gib 8]

Each section runs in try/except (an error is printed and the next section runs); a table of
the figures is printed last and written to $OUT/gpu_kvquant.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
from gpu_common import sections  # scripts/ is on sys.path when run as a script

from roofline import LLM, SamplingParams
from roofline.bench import latency, throughput, workloads
from roofline.bench.ceilings import measure, time_fn
from roofline.kernels.decode_attention import decode_attention, decode_attention_ref
from roofline.kernels.kv_store import rotary_kv_store, rotary_kv_store_ref, store_kv, store_kv_ref
from roofline.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from roofline.quantization.kv_cache import KVCacheSpec, quantize

DEV = torch.device("cuda")
PAGE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
SUMMARY: dict[str, object] = {}


def _failed(name: str, e: Exception) -> None:
    SUMMARY[f"{name} error"] = f"{type(e).__name__}: {e}"


section = sections(_failed)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _paged(num_reqs: int, ctx: int, heads: int, kv_heads: int, dim: int, page: int, dtype):
    """Random K/V over shuffled pages: (q, k_cache, v_cache, block_table, seq_lens)."""
    blocks = -(-ctx // page)
    num_pages = num_reqs * blocks
    gen = torch.Generator(device=DEV).manual_seed(0)
    k = torch.randn(num_pages, page, kv_heads, dim, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(num_pages, page, kv_heads, dim, device=DEV, dtype=dtype, generator=gen)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32)
    table = perm.view(num_reqs, blocks)
    seq_lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(num_reqs, heads, dim, device=DEV, dtype=dtype, generator=gen)
    return q, k, v, table, seq_lens


@section("1. kernel parity (fp8 / int8 pages, bf16, head_dim 128, 32 q / 8 kv heads)")
def parity() -> None:
    rows = {}
    for name, page_dtype in PAGE_DTYPES.items():
        # store and fused RoPE + store: bit-exact against the reference quantization
        gen = torch.Generator(device=DEV).manual_seed(1)
        n, kvh, dim, page = 300, 8, 128, 16
        k = torch.randn(n, kvh, dim, device=DEV, dtype=torch.bfloat16, generator=gen) * 4
        v = torch.randn(n, kvh, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
        q = torch.randn(n, 32, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
        slots = torch.randperm(64 * page, device=DEV, generator=gen)[:n]
        slots[::17] = -1
        spec = KVCacheSpec.create(name, torch.bfloat16)
        exact = True
        for fused in (False, True):
            data, scales = spec.allocate(1, 64, page, kvh, dim, DEV)
            got = [data[0, 0], data[0, 1], scales[0, 0], scales[0, 1]]
            ref = [t.clone() for t in got]
            if fused:
                pos = torch.randint(0, 4096, (n,), device=DEV, generator=gen)
                inv = 1.0 / 500000 ** (torch.arange(0, dim, 2, device=DEV).float() / dim)
                fr = torch.arange(4096, device=DEV).float()[:, None] * inv[None]
                cs = torch.cat([fr.cos(), fr.sin()], -1)
                rotary_kv_store_ref(q.clone(), k.clone(), v, pos, cs, *ref[:2], slots, *ref[2:])
                rotary_kv_store(q.clone(), k.clone(), v, pos, cs, *got[:2], slots, None, *got[2:])
            else:
                store_kv_ref(k, v, *ref[:2], slots, *ref[2:])
                store_kv(k, v, *got[:2], slots, *got[2:])
            for a, b in zip(got, ref):
                a8 = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
                b8 = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
                exact &= bool(torch.equal(a8, b8))
        # attention over quantized pages vs the reference over the dequantized pages
        q, kc, vc, table, seq_lens = _paged(8, 1000, 32, 8, 128, 16, torch.bfloat16)
        seq_lens = torch.tensor([1, 17, 128, 300, 511, 777, 999, 1000], device=DEV).int()
        kq, ks = quantize(kc, page_dtype)
        vq, vs = quantize(vc, page_dtype)
        dec = decode_attention(q, kq, vq, table, seq_lens, 0.088, k_scale=ks, v_scale=vs)
        dec_ref = decode_attention_ref(q, kq, vq, table, seq_lens, 0.088, ks, vs)
        qsl = torch.tensor([0, 1, 18, 146, 446, 957, 1734, 2733, 3733], device=DEV).int()
        qp = torch.randn(3733, 32, 128, device=DEV, dtype=torch.bfloat16)
        pre = prefill_attention(
            qp, kq, vq, table, qsl, seq_lens, 0.088, 1000, k_scale=ks, v_scale=vs
        )
        pre_ref = prefill_attention_ref(qp, kq, vq, table, qsl, seq_lens, 0.088, ks, vs)
        dec_err = (dec.float() - dec_ref.float()).abs().max().item()
        pre_err = (pre.float() - pre_ref.float()).abs().max().item()
        ok = exact and dec_err < 2e-2 and pre_err < 2e-2
        rows[name] = {
            "store_bit_exact": exact,
            "decode_max_err": dec_err,
            "prefill_max_err": pre_err,
            "ok": ok,
        }
        print(
            f"{name}: store/RoPE+store bit-exact {exact}, decode max err {dec_err:.2e}, "
            f"prefill max err {pre_err:.2e} -> {'OK' if ok else 'FAIL'}",
            flush=True,
        )
    SUMMARY["parity"] = rows


@section("2. decode attention kernel, batch 32 x 8192 context, 32 q / 8 kv heads")
def kernel_bench(ceil) -> None:
    q, kc, vc, table, seq_lens = _paged(32, 8192, 32, 8, 128, 16, torch.bfloat16)
    rows = {}
    for name in ("bf16", "fp8", "int8"):
        if name == "bf16":
            args, kw = (q, kc, vc, table, seq_lens, 0.088), {}
            kv_bytes = 2 * kc.numel() * 2
        else:
            kq, ks = quantize(kc, PAGE_DTYPES[name])
            vq, vs = quantize(vc, PAGE_DTYPES[name])
            args, kw = (q, kq, vq, table, seq_lens, 0.088), {"k_scale": ks, "v_scale": vs}
            kv_bytes = 2 * (kq.numel() + ks.numel() * 4)
        t = time_fn(lambda a=args, k=kw: decode_attention(*a, max_seq_len=8192, **k), DEV, iters=20)
        gbs = kv_bytes / t / 1e9
        rows[name] = {
            "us": t * 1e6,
            "GB/s": gbs,
            "pct_copy": 100 * gbs * 1e9 / ceil.bandwidth_bytes_per_s,
        }
        print(
            f"{name:>5}: {t * 1e6:8.1f} us, {gbs:7.0f} GB/s of KV = "
            f"{rows[name]['pct_copy']:.0f}% of copy bandwidth",
            flush=True,
        )
        if name != "bf16":
            del kq, vq, ks, vs
    SUMMARY["decode_kernel_b32_8k"] = rows


def _load(kv: str, **kw) -> LLM:
    return LLM("llama-3.1-8b", load_format="dummy", device="cuda", kv_cache_dtype=kv, **kw)


def _weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


@section("3. Llama-3.1-8B decode step, batch 32, 8192-token contexts: bf16 KV vs fp8 KV")
def decode_step(ceil) -> None:
    rows = {}
    for kv in ("auto", "fp8"):
        llm = _load(
            kv,
            max_model_len=8320,
            max_num_seqs=32,
            max_num_batched_tokens=16384,
            gpu_memory_utilization=0.92,
        )
        engine = llm.llm_engine
        row = latency.run_batch(engine, ceil, 32, 8192, 48)
        cfg = engine.model_config
        spec = engine.runner.kv_spec
        kv_bytes = (
            32
            * (8192 + 24)
            * spec.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        )
        roof_ms = (_weight_bytes(llm) + kv_bytes) / ceil.bandwidth_bytes_per_s * 1e3
        rows[kv] = {
            "step_ms_p50": row.step_ms_p50,
            "roofline_ms": roof_ms,
            "pct_roofline": 100 * roof_ms / row.step_ms_p50,
        }
        print(
            f"KV {kv:>4}: step {row.step_ms_p50:.2f} ms (p90 {row.step_ms_p90:.2f}), roofline "
            f"{roof_ms:.2f} ms = {rows[kv]['pct_roofline']:.0f}%",
            flush=True,
        )
        del llm, engine
        free()
    speedup = rows["auto"]["step_ms_p50"] / rows["fp8"]["step_ms_p50"]
    print(f"fp8 KV speed-up: {speedup:.2f}x (goal >= 1.3x)", flush=True)
    SUMMARY["decode_b32_8k"] = {**rows, "speedup": speedup}


@section("4. offline workload at a fixed KV budget: auto vs fp8 KV; fp8 greedy agreement")
def concurrency(ceil, budget_gib: float) -> None:
    wl = workloads.synthetic(256, (100, 1024), (512, 512), 128256)
    probes = [p[:64] for p in wl.prompts[:16]]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rows, tokens = {}, {}
    for kv in ("auto", "fp8"):
        llm = _load(
            kv,
            max_model_len=2048,
            max_num_seqs=256,
            kv_cache_memory_bytes=int(budget_gib * (1 << 30)),
        )
        pages = llm.llm_engine.runner.num_pages
        tokens[kv] = [o.outputs[0].token_ids for o in llm.generate(probes, greedy, use_tqdm=False)]
        r = throughput.run(llm, ceil, wl, use_tqdm=False)
        rows[kv] = {
            "pool_tokens": pages * 16,
            "peak_running": r.max_running,
            "preemptions": r.num_preemptions,
            "out_tok_s": r.output_tok_s,
        }
        print(
            f"KV {kv:>4}: pool {pages * 16} tokens, peak running {r.max_running}, "
            f"preemptions {r.num_preemptions}, {r.output_tok_s:.0f} out tok/s",
            flush=True,
        )
        del llm
        free()
    same = [sum(1 for _ in _prefix(a, b)) for a, b in zip(tokens["auto"], tokens["fp8"])]
    match = sum(a == b for x, y in zip(tokens["auto"], tokens["fp8"]) for a, b in zip(x, y))
    total = sum(len(x) for x in tokens["auto"])
    print(
        f"fp8 vs bf16 KV greedy (16 prompts x 32 tokens): {match}/{total} tokens equal by "
        f"position, identical prefix mean {sum(same) / len(same):.1f} tokens",
        flush=True,
    )
    SUMMARY["fixed_budget"] = {
        **rows,
        "greedy_equal": match / total,
        "mean_identical_prefix": sum(same) / len(same),
    }


def _prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-budget-gib", type=float, default=8.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ceil = measure(DEV, torch.bfloat16)
    print(f"{ceil.device_name}: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy_TB_s"] = ceil.bandwidth_bytes_per_s / 1e12
    parity()
    kernel_bench(ceil)
    decode_step(ceil)
    concurrency(ceil, args.kv_budget_gib)
    print("\n=== summary")
    print(json.dumps(SUMMARY, indent=1, default=str))
    with open(os.path.join(args.out, "gpu_kvquant.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
