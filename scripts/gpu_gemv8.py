"""Batch-1 decode of the quantized methods on an H100 (Llama-3.1-8B config, random weights):
``kernels.int4_gemv`` for int4 g128, int8 and fp8 e4m3, and where a decode layer's time goes.

1. parity on the GPU: every layout (repacked int4, int8 nibble planes, per-channel int8 read as
   it is "i8", fp8, canonical int4; without ``--quick`` group-128 int8 bytes) against x
   times the exactly dequantized weight at one and 16 rows, the norm / SiLU prologues, the
   residual epilogue and the SiLU epilogue (bit-exact against ``silu_and_mul``);
2. i8 against the nibble planes and fp8 at the same bytes, per 8B shape at one row, plain and in
   the fused decode layer's variants (norm prologue, SiLU epilogue, residual); i8's configs
   swept (two tiles preloaded among them) and installed (``scripts/gemv8_int8.py``);
3. the one-copy layouts (i8; canonical int4 "c4", x permuted per tile) swept at 4 / 8 / 16 rows
   against the two-copy layouts they replace, and c4 at one row in the decode layer's call
   (``scripts/gemv8_batch.py``; winners installed);
4. (not ``--quick``) the canonical int4 bytes vs the repacked copy with the halves-moving path of
   before, and the fused decode MLP at one row, 8 layers in a CUDA graph per format: the SiLU in
   the gate | up GEMV's epilogue vs its own launch vs the down projection's prologue;
5. 8B batch-1 decode per method (the int8 and int4 layouts also at ``--batches``; ``/planes``:
   int8 on the repacked nibble planes, a second copy; ``/repack``: int4 on a repacked copy
   instead of its canonical bytes (the default); ``/pairs``: int4's (scale, offset) pairs, a
   copy, instead of its scales alone; ``/pf64k``: 64 KB of weight prefetched per program before
   the PDL wait (slower: 8B int8 / int4 / fp8 295 / 367 / 277 vs 303 / 402 / 296 tok/s);
   ``/fusedattn``: the fused decode attention at every shape), each beside its roofline (weight
   bytes + KV over the copy bandwidth of this run), the weights' GiB read and resident, and a
   kernel profile with each kernel's exclusive time (its part of the step not overlapped by the
   kernel before it).

``--full-sweep`` adds the one-row config sweep of every format (with ``preload``: the first tile
in registers before the PDL wait), int4_gemv's row tiles against ``mixed_gemm`` at 32-256 rows
and the attention-layer chain. Each section prints its error and goes on; the summary table
comes last.

    python scripts/gpu_gemv8.py --quick --batches 8,32    # about 2.5 minutes
    python scripts/gpu_gemv8.py --final --batches 8,32    # about 1.5 minutes (merged main)
    python scripts/gpu_gemv8.py                  # about 3 minutes
    python scripts/gpu_gemv8.py --full-sweep     # about 4 minutes
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
import traceback
from functools import partial

import gemv8_batch  # scripts/ is on sys.path when run as a script
import gemv8_chains
import gemv8_int8
import gemv8_sweeps
import gpu_quant
import quant_decode_bench as qdb
import torch
from gemv8_common import (
    DEVICE,
    FORMATS,
    SHAPES,
    SUMMARY,
    TABLE,
    bits_of,
    fmt_key,
    group_of,
    make_weight,
    section,
)  # fmt: skip

from roofline import LLM
from roofline.bench import latency
from roofline.bench.ceilings import measure
from roofline.kernels import decode_attention_fused as attn_fused
from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul, silu_and_mul_ref
from roofline.kernels.rmsnorm import rms_norm
from roofline.layers import fused_decode
from roofline.quantization import common


@section("parity")
def parity(formats: tuple[str, ...]) -> None:
    """Every layout against x times the exactly dequantized weight (picked configs, one and 16
    rows), the prologues and epilogues against the unfused kernels; compiles first, in parallel."""
    cases = []  # (fmt, layer, label, fn(warmup) -> out, ref thunk)
    for fmt in formats:
        for layer, (n, k) in SHAPES.items():
            words, pairs, _, deq = make_weight(fmt, n, k, seed=3)
            b = bits_of(fmt)
            run = partial(ig.int4_gemv, words=words, scale_pairs=pairs, bits=b)
            for m in (1, 16):
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                ref = (x.float() @ deq.T).to(x.dtype)
                cfg = ig.pick_config(n, k, group_of(fmt, k), m, x.device, fmt_key(fmt))
                cfg = cfg or ig.heuristic_config(n, k, group_of(fmt, k), m, 132)  # (quant_gemv's)
                cases.append((fmt, layer, f"M={m}", partial(run, x, config=cfg), ref))
            if fmt in ("fp8", "i8") and layer == "o":
                x = torch.randn(3, k, device=DEVICE, dtype=torch.float16)
                cases.append((fmt, layer, "fp16", partial(run, x), (x.float() @ deq.T).half()))
            if layer == "down":
                gu = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
                ref = (silu_and_mul_ref(gu).float() @ deq.T).to(gu.dtype)
                cases.append((fmt, layer, "silu", partial(run, gu, silu_mul=True), ref))
            elif layer in ("qkv", "gate_up"):
                h = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
                nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
                ref = (rms_norm(h, nw, 1e-5).float() @ deq.T).to(h.dtype)
                cases.append((fmt, layer, "norm", partial(run, h, norm=(nw, 1e-5)), ref))
                if layer == "gate_up":  # the SiLU epilogue vs silu_and_mul of the same GEMV
                    plain = partial(run, h, norm=(nw, 1e-5))
                    act = partial(run, h, norm=(nw, 1e-5), silu_out=True)
                    cases.append((fmt, layer, "silu_out", act, plain))
            else:
                x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
                res = torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16)
                ref = ((x.float() @ deq.T).to(x.dtype).float() + res.float()).to(x.dtype)
                cases.append((fmt, layer, "residual", partial(run, x, residual=res), ref))
    qdb.precompile([partial(fn, warmup=True) for *_, fn, _ in cases])
    worst = 0.0
    lines: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for fmt, layer, label, fn, ref in cases:
        if callable(ref):  # silu_out: silu_and_mul's bits of the plain GEMV's output
            got, plain = fn(), silu_and_mul(ref())
            err = qdb.rel_err(got, plain)
            SUMMARY[f"silu_out_exact_{fmt}"] = torch.equal(got, plain)
        else:
            err = qdb.rel_err(fn(), ref)
        worst = max(worst, err)
        lines[(fmt, layer)].append(f"{label} {err:.1e}")
    for (fmt, layer), errs in lines.items():
        print(f"{fmt:4} {layer:7}: max rel err " + ", ".join(errs))
    exact = {f: SUMMARY.get(f"silu_out_exact_{f}") for f in formats}
    print(f"SiLU epilogue bit-exact vs silu_and_mul: {exact}")
    SUMMARY["parity_worst"] = worst
    TABLE.append(
        f"parity int4/int8/fp8/canonical int4_gemv: worst max-rel error {worst:.2e} (bound 1e-2); "
        f"SiLU epilogue exact {exact}"
    )


def resident_bytes(model: torch.nn.Module) -> int:
    """CUDA bytes held by the model's tensors: parameters, buffers and tensor attributes (the
    kernels' repacked copies), each storage counted once."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        tensors = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        tensors += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.is_cuda:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def exclusive_profile(engine, label: str, steps: int = 20) -> None:
    """Kernel time per batch-1 decode step by name: the profiler's duration and the exclusive
    part (end - max(start, the latest end before it)): what each kernel adds to the step."""
    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10 + 3 * steps, ignore_eos=True)
    engine.add_request(f"profile-{label}", [(7 * j) % 1000 + 10 for j in range(128)], params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    dur: dict[str, float] = collections.defaultdict(float)
    excl: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    last_end = -1e30
    for e in events:
        name = e.name.split("(")[0][:60]
        start, end = e.time_range.start, e.time_range.end
        dur[name] += end - start
        excl[name] += max(0.0, end - max(start, last_end))
        count[name] += 1
        last_end = max(last_end, end)
    busy = sum(excl.values()) / steps
    lines = [
        f"profile {label} batch 1: wall {wall_us:.0f} us/step, busy (union of kernels) "
        f"{busy:.0f} us/step"
    ]
    for name in sorted(excl, key=lambda n: -excl[n])[:10]:
        lines.append(
            f"  {excl[name] / steps:7.1f} us/step exclusive, {dur[name] / steps:7.1f} duration, "
            f"{count[name] / steps:4.0f}x  {name}"
        )
    print("\n".join(lines), flush=True)
    SUMMARY[f"profile_{label}"] = lines


@section("decode per method")
def decode(
    ceil, methods: list[str], profiled: tuple[str, ...], extra_batches: tuple[int, ...] = (8,)
) -> None:
    for method in methods:
        quant, _, variant = method.partition("/")
        more = quant in ("int8", "int4") and variant in ("", "planes", "canon", "repack")
        batches = [1, *extra_batches] if more else [1]
        llm = None
        fused_shapes = set(attn_fused.UNFUSED_FASTER)
        canon4 = common.INT4_GEMV_CANONICAL  # the default: int4 read canonically
        try:
            common.USE_FP8_GEMV = variant != "old"
            common.INT4_GEMV_CANONICAL = {"canon": True, "repack": False}.get(variant, canon4)
            common.INT4_GEMV_PAIRS = variant == "pairs"
            common.INT8_GEMV_PLANES = variant == "planes"
            fused_decode.SILU_EPILOGUE = variant != "nosiluepi"
            ig.PREFETCH_BYTES = 65536 if variant == "pf64k" else 16384
            if variant == "fusedattn":  # every shape on the fused decode attention
                attn_fused.UNFUSED_FASTER.clear()
            t0 = time.perf_counter()
            llm = LLM(
                "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=1024,
                max_num_seqs=max(batches), kv_cache_memory_bytes=8 << 30,
                quantization=None if quant == "bf16" else quant,
            )  # fmt: skip
            torch.cuda.synchronize()
            startup = time.perf_counter() - t0
            model = llm.llm_engine.runner.model
            wbytes = gpu_quant.weight_bytes(llm)
            resident = resident_bytes(model)
            rows = latency.run(llm.llm_engine, ceil, batches, 128, 64)
            print(latency.format_rows(rows), flush=True)
            r = rows[0]
            roof = 1e3 / r.roofline_step_ms  # weights + KV over this run's copy bandwidth
            SUMMARY[f"decode_{method}"] = {
                "startup_s": startup, "weight_bytes": wbytes, "resident_bytes": resident,
                "bs1_tok_s": r.output_tok_s, "step_ms": r.step_ms_p50, "roofline_tok_s": roof,
                "step_ms_by_batch": {x.batch_size: x.step_ms_p50 for x in rows},
            }  # fmt: skip
            TABLE.append(
                f"{method:10} bs1 {r.output_tok_s:6.1f} tok/s = {r.roofline_pct:4.1f}% of its "
                f"roofline ({roof:5.0f}); step {r.step_ms_p50:.3f} ms; weights {wbytes / 2**30:.2f}"
                f" GiB read, {resident / 2**30:.2f} GiB resident; start-up {startup:.1f} s"
                + "".join(f"; b{x.batch_size} {x.step_ms_p50:.2f} ms" for x in rows[1:])
            )
            print(TABLE[-1], flush=True)
            if method in profiled:
                exclusive_profile(llm.llm_engine, method)
        except Exception as e:  # noqa: BLE001
            print(f"decode {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            attn_fused.UNFUSED_FASTER.update(fused_shapes)
            common.INT4_GEMV_CANONICAL = canon4
            common.INT8_GEMV_PLANES = False
            common.INT4_GEMV_PAIRS = False
            common.USE_FP8_GEMV = True
            fused_decode.SILU_EPILOGUE = True
            ig.PREFETCH_BYTES = 16384
            fused_decode.set_enabled(True)
            llm = None
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--full-sweep", action="store_true",
        help="also the one-row config sweep of every format and the row-tile sweep (~70 s more)",
    )  # fmt: skip
    ap.add_argument(
        "--quick", action="store_true",
        help="parity (int4, int8 planes, i8, fp8, c4), i8 vs planes vs fp8, c4 vs int4, decode",
    )  # fmt: skip
    ap.add_argument(
        "--final", action="store_true",
        help="parity, then decode bf16 / int8 / int4 (+ repacked) / fp8 (committed tables only)",
    )  # fmt: skip
    ap.add_argument(
        "--methods",
        default="bf16,int8,int8/planes,int4,int4/repack,fp8",
        help="decode runs; variants /planes (int8 repacked nibble planes) /repack (int4) /pairs "
        "/fusedattn /canon "
        "/nosiluepi /old (fp8 on quant_gemv) /pf64k",
    )  # fmt: skip
    ap.add_argument("--profile", default="int8,int4", help="decode runs to profile")
    ap.add_argument(
        "--batches", default="8", help="batch sizes beyond 1 for the int8 / int4 layouts' decode"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    bw = ceil.bandwidth_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy_bw"] = bw
    quick = args.quick or args.final
    parity(FORMATS + ("int4p", "c4") if quick else FORMATS + ("int4p", "c4", "c8"))
    if args.final:  # what the merged tables give, nothing installed in-process
        args.methods = "bf16,int8,int4,int4/repack,fp8"
    else:
        gemv8_int8.compare(bw)
        gemv8_batch.sweep(bw)
    if args.full_sweep:
        gemv8_sweeps.gemv_sweep(bw)
        gemv8_sweeps.row_tiles(bw)
        gemv8_chains.attention_chain()
    if not (args.quick or args.final):
        gemv8_batch.canon_sweep(bw)
        gemv8_chains.mlp_chain(bw)
    extra = tuple(int(b) for b in args.batches.split(",") if b)
    decode(ceil, args.methods.split(","), tuple(args.profile.split(",")), extra)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s)")
    print("\n".join(TABLE))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_gemv8.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
