"""A 16-bit dense GEMM for decode batches, ``out[M, N] = x[M, K] @ w[N, K]^T``, as a candidate
beside cuBLAS where cuBLAS leaves the H100 idle.

At a decode batch of a few hundred rows the linear layers of an 8B model sit at the H100's ridge
point (about 256 FLOP per weight byte): cuBLAS picks tiles that leave part of the last wave
empty (Llama-3.1-8B at 256 rows, measured: qkv 39.8 us against a 17 us memory floor, gate_up
135 us against 79 us). Here every operand goes through 2-D tensor descriptors (TMA on Hopper):
each program owns a ``[BLOCK_M, BLOCK_N]`` tile of ``out``, streams ``[BLOCK_M, BLOCK_K]`` tiles
of x and ``[BLOCK_N, BLOCK_K]`` tiles of w through a ``NUM_STAGES``-deep pipeline into fp32
accumulators on the tensor cores, and writes the tile rounded to the output dtype once. With
``SPLIT_K > 1`` (too few tiles to fill the GPU) program ``(tile, s)`` takes the ``s``-th slice
of K and writes fp32 partial sums; a second launch adds the slices in a fixed order and rounds,
so results do not depend on timing. ``scripts/gpu_presets.py`` measures the configs against
``torch.nn.functional.linear`` at the decode shapes; ``layers.linear.linear`` runs it only
for the (shape, rows) ranges listed in ``TUNED_CONFIGS``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels import check_device, is_interpret
from roofline.kernels.activation import _expf


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


def dense_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` accumulated in fp32, rounded once to x's dtype ([M, K] x [N, K] -> [M, N])."""
    return (x.float() @ w.float().T).to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _dense_gemm_kernel(
    x_desc, w_desc, out_desc, part_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)  # N tiles fastest: neighbours share the x tile in L2
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]
        b = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
        if SILU_MUL:  # the up projection's rows follow the gate's N rows
            b_up = w_desc.load([N + off_n, k])  # [BLOCK_N, BLOCK_K]
            acc_up = tl.dot(a, b_up.T, acc_up)
    if SILU_MUL:  # the unfused path's numerics: gate and up rounded, SiLU as activation.py
        g = acc.to(out_desc.dtype).to(tl.float32)
        act = tl.math.div_rn(g, 1.0 + _expf(-g, LIBDEVICE)).to(out_desc.dtype).to(tl.float32)
        acc = act * acc_up.to(out_desc.dtype).to(tl.float32)
    if SPLIT_K == 1:
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))
    else:  # fp32 partials [SPLIT_K, M, N]
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ptrs = part_ptr + (split * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["num_elements"])
def _split_k_sum_kernel(
    part_ptr, out_ptr, num_elements, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits every run
        total += tl.load(part_ptr + s * num_elements + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def dense_gemm(
    x: torch.Tensor,  # [M, K] bf16/fp16, contiguous
    w: torch.Tensor,  # [N, K] same dtype, contiguous ([2I, K] with silu_mul)
    config: GemmConfig,
    out: torch.Tensor | None = None,  # [M, N] ([M, I] with silu_mul)
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N]
    """``x @ w.T``; with ``silu_mul`` (an MLP's packed gate_up weight) ``silu(gate) * up`` of
    it, with the unfused path's roundings (``kernels/activation.py``), and no split-K."""
    check_device(x, w)
    (m, k), (n, k_w) = x.shape, w.shape
    if k != k_w or x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dense_gemm: x {tuple(x.shape)} {x.dtype} vs w {tuple(w.shape)}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("dense_gemm needs contiguous operands")
    if silu_mul:
        if n % 2 or config.split_k != 1 or (n // 2) % config.block_n:
            raise ValueError("silu_mul needs [2I, K] weights, I a multiple of block_n, no split-K")
        n //= 2
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages, split_k = config
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [bm, bk])
    w_desc = TensorDescriptor(w, [w.shape[0], k], [k, 1], [bn, bk])
    out_desc = TensorDescriptor(out, [m, n], [n, 1], [bm, bn])
    part = out
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split_k)
    _dense_gemm_kernel[grid](
        x_desc, w_desc, out_desc, part, m, n, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, SPLIT_K=split_k,
        SILU_MUL=silu_mul, LIBDEVICE=not is_interpret(), num_warps=warps,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
            part, out, m * n, SPLIT_K=split_k, BLOCK=block
        )
    return out


TUNED_CONFIGS: dict[tuple[int, int], list[tuple[int, int, GemmConfig]]] = {}
"""(N, K) -> [(min_rows, max_rows, config)]: the row ranges where a config beat cuBLAS on an
H100 (``scripts/gpu_presets.py``); ``layers.linear.linear`` runs those, cuBLAS the rest."""


TUNED_SILU_CONFIGS: dict[tuple[int, int], list[tuple[int, int, GemmConfig]]] = {}
"""The same for an MLP's packed gate_up weight ``[2I, K]`` with the SiLU-and-mul fused (keyed
by ``(2I, K)``): where it beat cuBLAS plus the activation kernel."""


def tuned_config(n: int, k: int, m: int, silu_mul: bool = False) -> GemmConfig | None:
    """The measured config for ``[m, k] x [n, k]^T``, or None (cuBLAS)."""
    table = TUNED_SILU_CONFIGS if silu_mul else TUNED_CONFIGS
    for lo, hi, config in table.get((n, k), ()):
        if lo <= m <= hi:
            return config
    return None


CANDIDATES = [
    GemmConfig(128, 128, 64, 8, 4),
    GemmConfig(128, 256, 64, 8, 3),
    GemmConfig(64, 128, 64, 4, 5),
    GemmConfig(128, 64, 64, 4, 5),
    GemmConfig(128, 128, 64, 8, 4, split_k=2),
    GemmConfig(64, 256, 64, 8, 4),
]
"""Configs ``scripts/gpu_presets.py`` times at the decode shapes."""
SILU_CANDIDATES = [
    GemmConfig(128, 128, 64, 8, 3),
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 64, 64, 4, 4),
]
"""The same with the SiLU-and-mul epilogue (two weight tiles per stage: less shared memory)."""


__all__ = [
    "CANDIDATES",
    "SILU_CANDIDATES",
    "TUNED_CONFIGS",
    "TUNED_SILU_CONFIGS",
    "GemmConfig",
    "dense_gemm",
    "dense_gemm_ref",
    "tuned_config",
]
