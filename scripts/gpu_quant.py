"""The quantization GPU session in one process (H100, Llama-3.1-8B config, random weights):

1. parity of every dequant kernel against its torch reference at M = 1, 4, 16, 64 on the 8B's
   linear shapes (fused dequant GEMM, dequantize-into-cuBLAS, the SiLU-fused down projection,
   fp8 W8A8 on ``torch._scaled_mm``);
2. kernel GB/s of quantized bytes at M = 1, 4, 16, 64 against the measured copy bandwidth;
3. per method (bf16, int8, int4 g128, fp8, fp8-w8a8): start-up with on-the-fly quantization,
   batch-1 decode tok/s beside its roofline (quantized weight bytes + scales + 16-bit LM head
   over the copy bandwidth), decode step time at batch 8 / 32 / 128;
4. offline throughput, fp8 W8A8 vs bf16 (the bench throughput workload, fewer requests);
5. final-logits max / mean relative error vs bf16 per weight method (HF model on the engine's
   random weights, each linear weight replaced by its quantize-dequantize round trip).

Each section prints its error and goes on; a short table comes last.

    python scripts/gpu_quant.py [--requests 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

from roofline import LLM
from roofline.bench import latency, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.bench.kernels import time_cuda
from roofline.kernels.activation import silu_and_mul_ref
from roofline.kernels.dequant_gemm import (
    dequant_cublas_gemm,
    dequant_gemm,
    dequant_gemm_ref,
    dequantize_weight,
)
from roofline.layers.linear import MergedLinear
from roofline.quantization import formats
from roofline.quantization.fp8 import _scaled_mm, w8a8_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16, 64)
METHODS = ("int8", "int4", "fp8")
SUMMARY: dict[str, object] = {}
TABLE: list[str] = []


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                SUMMARY[f"{name}_error"] = repr(e)
            finally:
                print(f"({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
                gc.collect()
                torch.cuda.empty_cache()

        return run

    return wrap


def quantized(kind: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    if kind == "int8":
        q = formats.quantize_int8(w, k, torch.bfloat16)
        return q.qweight, q.scales, None
    if kind == "int4":
        return tuple(formats.quantize_int4(w, 128, True, torch.bfloat16))
    q, s = formats.quantize_fp8(w)
    return q, s, None


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@section("kernel parity")
def parity() -> None:
    worst = 0.0
    for kind in METHODS:
        for layer, (n, k) in SHAPES.items():
            qw, s, o = quantized(kind, n, k)
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = dequant_gemm_ref(kind, x, qw, s, o).float()
                scale = ref.abs().max().item()
                fused = (dequant_gemm(kind, x, qw, s, o).float() - ref).abs().max().item() / scale
                w = dequantize_weight(kind, qw, s, o, torch.bfloat16)
                cublas = (F.linear(x, w).float() - ref).abs().max().item() / scale
                worst = max(worst, fused, cublas)
                print(f"{kind:5} {layer:8} M={m:3}: fused {fused:.2e} dequant+cuBLAS {cublas:.2e}")
            if layer == "down":
                gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
                ref = dequant_gemm_ref(kind, silu_and_mul_ref(gate_up), qw, s, o).float()
                got = dequant_gemm(kind, gate_up, qw, s, o, silu_mul=True).float()
                err = (got - ref).abs().max().item() / ref.abs().max().item()
                worst = max(worst, err)
                print(f"{kind:5} down+silu_mul M=1: {err:.2e}")
    qw, s, _ = quantized("fp8", 4096, 4096)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    ref = w8a8_ref(x.float(), qw, s, None)
    err = (_scaled_mm(x, qw, s, None).float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"fp8 W8A8 _scaled_mm M=64 vs reference: {err:.2e}")
    SUMMARY["parity_worst_rel_err"] = max(worst, err)
    TABLE.append(f"kernel parity: worst max-rel error {max(worst, err):.2e} (bf16 rounding ~4e-3)")


@section("kernel bandwidth")
def bandwidth(copy_bw: float) -> None:
    rows = []
    for kind in METHODS:
        for layer, (n, k) in SHAPES.items():
            qw, s, o = quantized(kind, n, k)
            q_bytes = nbytes(qw, s, o)
            for m in (*ROWS, 128, 256):  # 128 / 256: where dequant + cuBLAS should take over
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_fused = time_cuda(functools.partial(dequant_gemm, kind, x, qw, s, o), 3, 20)
                t_deq = time_cuda(functools.partial(dequant_cublas_gemm, kind, x, qw, s, o), 3, 20)
                gbps = q_bytes / t_fused / 1e9
                rows.append((kind, layer, m, t_fused * 1e6, gbps, t_deq * 1e6))
                print(
                    f"{kind:5} {layer:8} M={m:3}: fused {t_fused * 1e6:7.1f} us "
                    f"{gbps:6.0f} GB/s ({100 * gbps * 1e9 / copy_bw:3.0f}% of copy), "
                    f"dequant+cuBLAS {t_deq * 1e6:7.1f} us",
                    flush=True,
                )
    SUMMARY["kernel_bandwidth"] = rows
    for kind in METHODS:
        best = max(r[4] for r in rows if r[0] == kind and r[2] == 1)
        TABLE.append(f"{kind} fused GEMV M=1 best {best:.0f} GB/s of quantized bytes")


def weight_bytes(llm: LLM) -> int:
    """Bytes batch-1 decode reads for weights: every linear (quantized + scales), the 16-bit LM
    head (the tied embedding when there is no head), the norms."""
    model = llm.llm_engine.runner.model
    total = sum(m.method.weight_bytes(m) for m in model.modules() if isinstance(m, MergedLinear))
    if model.lm_head is None:
        total += nbytes(model.embed_tokens.weight)
    total += sum(nbytes(p) for n, p in model.named_parameters() if n.endswith("norm.weight"))
    return total


@section("decode per method")
def decode(ceil, methods: list[str]) -> None:
    for method in methods:
        try:
            t0 = time.perf_counter()
            llm = LLM(
                "llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=1024,
                max_num_seqs=128, kv_cache_memory_bytes=8 << 30,
                quantization=None if method == "bf16" else method,
            )  # fmt: skip
            torch.cuda.synchronize()
            startup = time.perf_counter() - t0
            wbytes = weight_bytes(llm)
            roof_tok_s = ceil.bandwidth_bytes_per_s / wbytes
            rows = latency.run(llm.llm_engine, ceil, [1, 8, 32, 128], 128, 32)
            print(latency.format_rows(rows), flush=True)
            tok_s = rows[0].output_tok_s
            steps = {r.batch_size: r.step_ms_p50 for r in rows}
            SUMMARY[f"decode_{method}"] = {
                "startup_s": startup, "weight_bytes": wbytes, "bs1_tok_s": tok_s,
                "roofline_tok_s": roof_tok_s, "step_ms": steps,
            }  # fmt: skip
            TABLE.append(
                f"{method:9} start-up {startup:5.1f} s, weights {wbytes / 2**30:5.2f} GiB, bs1 "
                f"{tok_s:6.1f} tok/s = {100 * tok_s / roof_tok_s:3.0f}% of {roof_tok_s:5.0f}; "
                "step ms b8/32/128 " + "/".join(f"{steps[b]:.2f}" for b in (8, 32, 128))
            )
            print(TABLE[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"decode {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            llm = None
            gc.collect()
            torch.cuda.empty_cache()


@section("offline throughput")
def offline(ceil, num_requests: int) -> None:
    for method in ("bf16", "fp8-w8a8"):
        llm = LLM(
            "llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=4096,
            max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
            quantization=None if method == "bf16" else method,
        )  # fmt: skip
        vocab = llm.llm_engine.model_config.vocab_size
        wl = workloads.synthetic(num_requests, (100, 1024), (512, 512), vocab)
        res = throughput.run(llm, ceil, wl, use_tqdm=False)
        SUMMARY[f"throughput_{method}"] = res.output_tok_s
        TABLE.append(
            f"throughput {method:9} {res.output_tok_s:6.0f} out tok/s ({num_requests} requests, "
            f"{res.elapsed_s:.1f} s, max running {res.max_running})"
        )
        print(TABLE[-1], flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if "throughput_bf16" in SUMMARY and "throughput_fp8-w8a8" in SUMMARY:
        ratio = SUMMARY["throughput_fp8-w8a8"] / SUMMARY["throughput_bf16"]
        TABLE.append(f"fp8 W8A8 / bf16 offline throughput: {ratio:.2f}x")


@section("logits error")
def logits_error() -> None:
    from roofline.bench import peers

    llm = LLM(
        "llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=512,
        kv_cache_memory_bytes=1 << 30, enforce_eager=True,
    )  # fmt: skip
    hf = peers.hf_model_from_engine(llm.llm_engine)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    ids = torch.arange(1000, 1128, device="cuda")[None]
    linears = {
        n: m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    }
    originals = {n: m.weight.detach().clone().cpu() for n, m in linears.items()}
    with torch.inference_mode():
        base = hf(ids).logits.float()[0]  # [128, vocab]
    for method in METHODS:
        with torch.no_grad():
            for n, m in linears.items():
                w = originals[n].cuda()
                if method == "int8":
                    q = formats.quantize_int8(w, w.shape[1], torch.bfloat16)
                    deq = formats.dequantize_int8(q.qweight, q.scales, torch.bfloat16)
                elif method == "int4":
                    q4 = formats.quantize_int4(w, 128, True, torch.bfloat16)
                    deq = formats.dequantize_int4(*q4, torch.bfloat16)
                else:
                    q8, s = formats.quantize_fp8(w)
                    deq = formats.dequantize_fp8(q8, s, torch.bfloat16)
                m.weight.copy_(deq)
        with torch.inference_mode():
            got = hf(ids).logits.float()[0]
        rel = (got - base).abs() / base.abs().amax(dim=-1, keepdim=True)
        SUMMARY[f"logits_err_{method}"] = (rel.max().item(), rel.mean().item())
        TABLE.append(
            f"logits vs bf16, {method:5}: max rel {rel.max().item():.3e}, "
            f"mean rel {rel.mean().item():.3e}, top-1 agreement "
            f"{(got.argmax(-1) == base.argmax(-1)).float().mean().item():.3f}"
        )
        print(TABLE[-1], flush=True)
    del hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--requests", type=int, default=96, help="offline throughput requests (256: full workload)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    bw = ceil.bandwidth_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    SUMMARY["copy_bw"] = bw
    parity()
    bandwidth(bw)
    decode(ceil, ["bf16", "int8", "int4", "fp8", "fp8-w8a8"])
    logits_error()
    offline(ceil, args.requests)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s)")
    print("\n".join(TABLE))
    with open(os.path.join(args.out, "gpu_quant.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
