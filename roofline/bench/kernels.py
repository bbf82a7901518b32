"""Kernel micro-benchmark against the roofline: ``python -m roofline.bench.kernels [--json PATH]``.

First measures the ceilings of the current GPU: HBM bandwidth as the faster of a device-to-device
copy of a 2 GiB tensor (bytes read + written) and a read-only pass over it, and tensor-core
throughput as a bf16 8192^3 matmul. Then times each roofline kernel with CUDA events (warm-up,
then the median over N CUDA-graph replays, so host launch cost is not counted) and
reports achieved GB/s (memory-bound kernels: the bytes each must move at least) or TFLOP/s
(prefill attention: the useful causal FLOPs) as a percentage of the matching ceiling. The
headline is paged decode attention at batch 64, context 4096, 32 query / 8 KV heads, head_dim
128, page 16, bf16, printed beside torch SDPA on contiguous K/V of the same shape; prefill
attention on one 8192-token prompt is likewise printed beside SDPA (causal). The fused MoE layer
of Qwen3-30B-A3B runs at 1, 16, 256 and 4096 tokens (GB/s over the touched experts, TFLOP/s).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from roofline.kernels.activation import silu_and_mul
from roofline.kernels.decode_attention import decode_attention, decode_attention_bytes
from roofline.kernels.kv_store import rotary_kv_store, store_kv
from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention
from roofline.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from roofline.kernels.rotary import apply_rotary


@dataclass
class Result:
    name: str
    shape: str
    time_us: float
    achieved: float
    unit: str  # "GB/s" or "TFLOP/s"
    pct_of_ceiling: float


def time_cuda(fn: Callable[[], object], warmup: int, iters: int, reps: int = 10) -> float:
    """Median seconds of one ``fn`` call, from ``iters`` CUDA-graph replays of ``reps`` calls.

    Graph replay takes the host out of the measurement (a Triton launch costs the CPU more than
    a short kernel costs the GPU; the engine hides that with CUDA graphs too). Falls back to
    eager launches, one per event pair, when ``fn`` cannot be captured.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run: Callable[[], object] = graph.replay
    except RuntimeError:
        run, reps = fn, 1
    run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    times_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return statistics.median(times_ms) / reps / 1e3


class Bench:
    def __init__(self, warmup: int, iters: int) -> None:
        self.warmup, self.iters = warmup, iters
        self.results: list[Result] = []
        self.copy_gbps = 0.0
        self.matmul_tflops = 0.0

    def ceilings(self) -> None:
        self._copy_ceiling()
        torch.cuda.empty_cache()
        self._matmul_ceiling()

    def _copy_ceiling(self) -> None:
        """HBM ceiling: the faster of a 2 GiB copy (read + write) and a 2 GiB read-only pass.

        Attention decode is read-dominated and reads stream faster than copies, so a copy-only
        ceiling would let decode score over 100%.
        """
        x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
        y = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        sec = time_cuda(lambda: y.copy_(x), self.warmup, self.iters, reps=4)
        copy_gbps = 2 * nbytes / sec / 1e9
        partial = torch.empty(2**14, dtype=torch.float32, device="cuda")
        rows = x.view(2**14, -1)  # [16384, 65536]
        read_sec = time_cuda(
            lambda: torch.sum(rows, dim=1, dtype=torch.float32, out=partial),
            self.warmup, self.iters, reps=4,
        )  # fmt: skip
        read_gbps = nbytes / read_sec / 1e9
        self.copy_gbps = max(copy_gbps, read_gbps)
        self.add("ceiling: d2d copy", "2 GiB", sec, copy_gbps, "GB/s")
        self.add("ceiling: read (row sums)", "2 GiB", read_sec, read_gbps, "GB/s")

    def _matmul_ceiling(self) -> None:
        n = 8192
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        sec = time_cuda(lambda: a @ b, self.warmup, self.iters)
        self.matmul_tflops = 2 * n**3 / sec / 1e12
        self.add("ceiling: bf16 matmul", f"{n}^3", sec, self.matmul_tflops, "TFLOP/s")

    def add(self, name: str, shape: str, sec: float, achieved: float, unit: str) -> None:
        ceiling = self.copy_gbps if unit == "GB/s" else self.matmul_tflops
        pct = 100 * achieved / ceiling if ceiling else 100.0
        self.results.append(Result(name, shape, sec * 1e6, achieved, unit, pct))

    def bandwidth(self, name: str, shape: str, fn: Callable[[], object], nbytes: int) -> None:
        sec = time_cuda(fn, self.warmup, self.iters)
        self.add(name, shape, sec, nbytes / sec / 1e9, "GB/s")

    def flops(self, name: str, shape: str, fn: Callable[[], object], nflops: int) -> None:
        sec = time_cuda(fn, self.warmup, self.iters)
        self.add(name, shape, sec, nflops / sec / 1e12, "TFLOP/s")


def paged_cache(
    num_reqs: int, seq_len: int, num_kv_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random K/V caches holding ``num_reqs`` sequences on shuffled pages, and their block table."""
    blocks = (seq_len + page_size - 1) // page_size
    num_pages = num_reqs * blocks
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_pages, device="cuda", dtype=torch.int64)
    block_table = perm.view(num_reqs, blocks).to(torch.int32)  # [num_reqs, blocks]
    return k_cache, v_cache, block_table


def bench_decode(bench: Bench, num_reqs: int, seq_len: int, with_sdpa: bool) -> None:
    num_heads, num_kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    k_cache, v_cache, block_table = paged_cache(
        num_reqs, seq_len, num_kv_heads, head_dim, page_size, dtype
    )
    q = torch.randn(num_reqs, num_heads, head_dim, dtype=dtype, device="cuda")
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    nbytes = decode_attention_bytes(num_reqs, seq_len, num_heads, num_kv_heads, head_dim, 2)
    shape = f"B={num_reqs} ctx={seq_len} H={num_heads}/{num_kv_heads} d={head_dim} page={page_size}"
    out = torch.empty_like(q)
    bench.bandwidth(
        "decode_attention (paged)", shape,
        lambda: decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                 max_seq_len=seq_len, out=out),
        nbytes,
    )  # fmt: skip
    if not with_sdpa:
        return
    k = torch.randn(num_reqs, num_kv_heads, seq_len, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    bench.bandwidth(
        "torch sdpa (contiguous K/V)", shape,
        lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
        nbytes,
    )  # fmt: skip


def bench_prefill(bench: Bench, seq_len: int) -> None:
    num_heads, num_kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    k_cache, v_cache, block_table = paged_cache(
        1, seq_len, num_kv_heads, head_dim, page_size, dtype
    )
    q = torch.randn(seq_len, num_heads, head_dim, dtype=dtype, device="cuda")
    qsl = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    nflops = causal_attention_flops([seq_len], [seq_len], num_heads, head_dim)
    shape = f"1 x {seq_len} causal H={num_heads}/{num_kv_heads} d={head_dim} page={page_size}"
    out = torch.empty_like(q)
    bench.flops(
        "prefill_attention (paged)", shape,
        lambda: prefill_attention(q, k_cache, v_cache, block_table, qsl, seq_lens, scale,
                                  max_query_len=seq_len, out=out),
        nflops,
    )  # fmt: skip
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
    k = torch.randn(1, num_kv_heads, seq_len, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    bench.flops(
        "torch sdpa (causal, contiguous)", shape,
        lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True),
        nflops,
    )  # fmt: skip


def bench_pointwise(bench: Bench) -> None:
    # Shapes large enough that inputs + outputs overflow the L2 (50-60 MB on H100/H200).
    num_tokens, hidden, inter, dtype = 16384, 4096, 14336, torch.bfloat16
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, dtype=dtype, device="cuda")
    row = x.numel() * 2
    shape = f"{num_tokens} x {hidden}"
    bench.bandwidth("rms_norm", shape, lambda: rms_norm(x, weight, 1e-6), 2 * row)
    bench.bandwidth(
        "fused_add_rms_norm", shape, lambda: fused_add_rms_norm(x, residual, weight, 1e-6), 4 * row
    )

    gate_up = torch.randn(num_tokens, 2 * inter, dtype=dtype, device="cuda")
    bench.bandwidth(
        "silu_and_mul", f"{num_tokens} x 2*{inter}", lambda: silu_and_mul(gate_up),
        3 * num_tokens * inter * 2,
    )  # fmt: skip

    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    max_pos = 32768
    positions = torch.randint(0, max_pos, (num_tokens,), device="cuda")
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, head_dim] fp32
    qk_bytes = 2 * (q.numel() + k.numel()) * 2 + num_tokens * head_dim * 4
    shape = f"T={num_tokens} H={num_heads}/{num_kv_heads} d={head_dim}"
    bench.bandwidth("rotary (in place)", shape, lambda: apply_rotary(q, k, positions, cos_sin),
                    qk_bytes)  # fmt: skip

    page_size = 16
    k_cache = torch.empty(num_tokens // page_size, page_size, num_kv_heads, head_dim,
                          dtype=dtype, device="cuda")  # fmt: skip
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_tokens, device="cuda")
    kv_bytes = 4 * k.numel() * 2
    bench.bandwidth("store_kv", shape, lambda: store_kv(k, v, k_cache, v_cache, slots), kv_bytes)
    bench.bandwidth(
        "rotary_kv_store (fused)", shape,
        lambda: rotary_kv_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots),
        qk_bytes + 3 * k.numel() * 2,
    )  # fmt: skip


def bench_moe(bench: Bench) -> None:
    """The fused MoE layer (routing + expert GEMMs) of Qwen3-30B-A3B (128 experts, top-8, hidden
    2048, expert width 768): GB/s over the experts the tokens touch (decode sizes), TFLOP/s of
    the active experts' GEMMs at 4096 tokens."""
    from roofline.kernels.fused_moe import fused_moe, route

    num_experts, top_k, hidden, inter, dtype = 128, 8, 2048, 768, torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda").mul_(0.02).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, device="cuda").mul_(0.02).to(dtype)
    router = torch.randn(num_experts, hidden, device="cuda").mul_(0.02).to(dtype)
    for num_tokens in (1, 16, 256, 4096):
        x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
        logits = x @ router.T

        def layer(x=x, logits=logits):
            weights, ids = route(logits, top_k, True)
            return fused_moe(x, w13, w2, weights, ids)

        touched = int(torch.unique(route(logits, top_k, True)[1]).numel())
        shape = f"T={num_tokens} E={num_experts} k={top_k} {hidden}x{inter} ({touched} touched)"
        if num_tokens < 4096:
            nbytes = touched * 3 * hidden * inter * 2 + 2 * x.numel() * 2
            bench.bandwidth("fused_moe (Qwen3-30B-A3B layer)", shape, layer, nbytes)
        else:
            bench.flops("fused_moe (Qwen3-30B-A3B layer)", shape, layer,
                        2 * num_tokens * top_k * 3 * hidden * inter)  # fmt: skip


def bench_dequant(bench: Bench) -> None:
    """Fused dequant GEMMs (``kernels.dequant_gemm``) on the Llama-3.1-8B gate/up and down
    shapes at M = 1, 4, 16, 64: GB/s of quantized bytes (weights + scales + offsets), beside the
    dequantize-into-cuBLAS path."""
    from roofline.kernels.dequant_gemm import dequant_cublas_gemm, dequant_gemm
    from roofline.quantization import formats

    for n, k in [(28672, 4096), (4096, 14336)]:
        w = torch.randn(n, k, device="cuda") * 0.02
        int8 = formats.quantize_int8(w, k, torch.bfloat16)
        int4 = formats.quantize_int4(w, 128, True, torch.bfloat16)
        fp8 = formats.quantize_fp8(w)
        cases = {
            "int8": (int8.qweight, int8.scales, None),
            "int4 g128": tuple(int4),
            "fp8": (fp8[0], fp8[1], None),
        }
        del w
        for label, (qw, s, o) in cases.items():
            kind = label.split()[0]
            nbytes = sum(t.numel() * t.element_size() for t in (qw, s, o) if t is not None)
            for m in (1, 4, 16, 64):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                shape = f"M={m} N={n} K={k}"
                bench.bandwidth(
                    f"dequant_gemm {label}", shape,
                    functools.partial(dequant_gemm, kind, x, qw, s, o), nbytes,
                )  # fmt: skip
                bench.bandwidth(
                    f"dequant+cuBLAS {label}", shape,
                    functools.partial(dequant_cublas_gemm, kind, x, qw, s, o), nbytes,
                )  # fmt: skip
        torch.cuda.empty_cache()


def print_table(results: list[Result]) -> None:
    header = f"{'kernel':34} {'shape':48} {'time us':>10} {'achieved':>16} {'% roof':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        achieved = f"{r.achieved:9.1f} {r.unit}"
        print(f"{r.name:34} {r.shape:48} {r.time_us:10.1f} {achieved:>16} {r.pct_of_ceiling:6.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--warmup", type=int, default=5, help="untimed launches per case")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per case (median)")
    parser.add_argument(
        "--only",
        choices=["decode", "prefill", "pointwise", "moe", "quant"],
        action="append",
        help="run only these groups (repeatable); default: all",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("roofline.bench.kernels needs a CUDA GPU (Triton kernels are timed on device).")
        return 2
    groups = set(args.only or ["decode", "prefill", "pointwise", "moe", "quant"])
    torch.manual_seed(0)
    bench = Bench(args.warmup, args.iters)
    bench.ceilings()
    if "decode" in groups:
        bench_decode(bench, 64, 4096, with_sdpa=True)  # the headline
        for num_reqs, seq_len in [(1, 131072), (8, 8192), (256, 1024)]:
            bench_decode(bench, num_reqs, seq_len, with_sdpa=False)
            torch.cuda.empty_cache()
    if "prefill" in groups:
        bench_prefill(bench, 8192)
    if "pointwise" in groups:
        bench_pointwise(bench)
    if "moe" in groups:
        bench_moe(bench)
    if "quant" in groups:
        bench_dequant(bench)
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}")
    print_table(bench.results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "results": [asdict(r) for r in bench.results]}, f,
                      indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
