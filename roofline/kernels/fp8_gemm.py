"""fp8 W8A8 GEMM through tensor descriptors (TMA on Hopper): ``out[M, N] = (xq[M, K] *
x_scales[M]) @ (qweight[N, K] * w_scales[N])^T (+ bias)``, both operands e4m3, an fp32
accumulator scaled once in the epilogue by the per-token and per-channel scales (what
``torch._scaled_mm`` with row-wise scales computes), rounded once to the output dtype.

Each ``BLOCK_K`` box of x and of the weight arrives by TMA (no address arithmetic per thread;
rows past M or N read as zeros, the store clips them) and meets the other in the fp8 tensor
cores. Tiles go M-fastest within groups of ``GROUP_M`` row blocks, so the row blocks that share
a weight tile run side by side and the weight is read from HBM about once.
``Fp8GemmConfig.persistent``: 0 launches one program per tile; 1 one program per SM walking the
tiles in a flattened loop (the next tile's loads overlap this one's epilogue); 2 the same loop
warp-specialized (a producer warp issues the TMA loads); 3 (``STREAM_K``) one program per SM
with the (tile, K step) iterations of the whole GEMM dealt out evenly, a tile shared by two or
more programs summed by the last to arrive (K order). ``split_k > 1`` (decode-sized row
counts: too few output tiles to fill the SMs) gives each program one slice of K; the fp32
partial tiles go to a workspace and the tile's last slice to arrive (an acq_rel atomic counts
arrivals) sums them in slice order, scales, stores and resets its counter: one launch,
deterministic, replayable in CUDA graphs. ``fp8_gemm_ref`` is the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels import check_device, num_sms
from roofline.kernels.dense_gemm import (
    MAX_SPLIT_TILES,
    _dot_k_tiles,
    _locks,
    _split_k_partial,
    _split_k_total,
    _tile_offsets,
)
from roofline.quantization.formats import FP8_DTYPE


class Fp8GemmConfig(NamedTuple):
    block_m: int  # rows of x per tile
    block_n: int  # weight rows (output columns) per tile
    block_k: int
    group_m: int  # row blocks walking the same weight columns together (L2 reuse)
    split_k: int  # K slices, each its own program (1: none)
    num_warps: int
    num_stages: int
    persistent: int = 0  # 0 a program per tile, 1 per SM (flattened), 2 per SM warp-specialized,
    # 3 (STREAM_K) per SM with the K steps of all tiles dealt out evenly (split_k unused)


STREAM_K = 3


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``dense_gemm._tile_offsets``' blocks, ``per_group`` computed here, the offsets left to
    the caller: with ``_tile_offsets`` the persistent kernel's flattened loop (FLATTEN)
    compiles to reordered sm_90 code (the same instructions), not measured on a GPU."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)  # row blocks in this (maybe last) group
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def _scaled(acc, xs_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] times the rows' and columns' scales (plus the bias), in fp32."""
    xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)  # [BM]
    ws = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)  # [BN]
    acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "num_programs"])
def _fp8_gemm_kernel(
    x_desc,  # fp8 [M, K], boxes [BLOCK_M, BLOCK_K]
    w_desc,  # fp8 [N, K], boxes [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N], boxes [BLOCK_M, BLOCK_N]
    xs_ptr,  # fp32 [M]
    ws_ptr,  # fp32 [N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    num_programs,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN,
        warp_specialize=WARP_SPEC,
    ):  # fmt: skip
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _dot_k_tiles(x_desc, w_desc, off_m, off_n, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = _scaled(acc, xs_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_gemm_split_kernel(
    x_desc,
    w_desc,
    out_desc,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    part_ptr,  # fp32 [split_k, M, N] partial tiles
    lock_ptr,  # int32 [tiles] arrival counters, zero between launches
    M,
    N,
    K,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    off_m, off_n = _tile_offsets(tile, tl.cdiv(M, BLOCK_M), GROUP_M * num_pid_n, GROUP_M,
                                 BLOCK_M, BLOCK_N)  # fmt: skip
    last, offs_m, offs_n, offs, mask, slice_size = _split_k_partial(
        x_desc, w_desc, part_ptr, lock_ptr, tile, part, split_k, off_m, off_n, M, N, K,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if last:  # the last slice to finish sums them all, in slice order
        total = _split_k_total(part_ptr, offs, mask, slice_size, split_k, BLOCK_M, BLOCK_N)
        total = _scaled(total, xs_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
        out_desc.store([off_m, off_n], total.to(out_desc.dtype))
        tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch (graph replays)


@triton.jit
def _owner(i, P, total):
    """The stream-K program whose iteration range ``[c total / P, (c + 1) total / P)`` holds
    iteration ``i``."""
    return ((i + 1) * P + total - 1) // total - 1


@triton.jit(do_not_specialize=["M", "max_parts"])
def _fp8_gemm_streamk_kernel(
    x_desc,
    w_desc,
    out_desc,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    part_ptr,  # fp32 [tiles, max_parts, BLOCK_M * BLOCK_N] partial tiles
    lock_ptr,  # int32 [tiles] arrival counters, zero between launches
    M,
    N,
    K,
    max_parts,  # programs a tile can be shared by
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Stream-K: the (tile, K step) iterations of the whole GEMM are dealt out evenly, program
    ``p`` of ``P`` taking ``[p T / P, (p + 1) T / P)``, so every SM gets the same work whatever
    the tile count. A program stores a tile it covers whole; a tile shared by several programs
    gets their partial sums in its slots (slot = program - the tile's first program) and the
    last to arrive sums them in slot order (K order), scales and stores it."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = num_pid_m * num_pid_n * k_tiles
    it = (pid * total) // P
    it_end = ((pid + 1) * total) // P
    offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while it < it_end:
        tile = it // k_tiles
        k0 = it - tile * k_tiles
        k1 = tl.minimum(k_tiles, k0 + it_end - it)
        off_m, off_n = _tile_offsets(tile, num_pid_m, GROUP_M * num_pid_n, GROUP_M, BLOCK_M,
                                     BLOCK_N)  # fmt: skip
        acc = _dot_k_tiles(x_desc, w_desc, off_m, off_n, k0, k1, BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if (k0 == 0) & (k1 == k_tiles):  # the whole tile: no one else adds to it
            acc = _scaled(acc, xs_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
            out_desc.store([off_m, off_n], acc.to(out_desc.dtype))
        else:
            first = _owner(tile * k_tiles, P, total)
            count = _owner(tile * k_tiles + k_tiles - 1, P, total) - first + 1
            slots = part_ptr + tile.to(tl.int64) * max_parts * (BLOCK_M * BLOCK_N)
            tl.store(slots + (pid - first) * (BLOCK_M * BLOCK_N) + offs_tile, acc)
            tl.debug_barrier()  # every thread's partial sums are written
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == count - 1:  # the last to finish sums the slots in K order
                total_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(count):  # .cg: from L2, never a stale L1 line
                    total_acc += tl.load(slots + s * (BLOCK_M * BLOCK_N) + offs_tile,
                                         cache_modifier=".cg")  # fmt: skip
                total_acc = _scaled(
                    total_acc, xs_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS
                )
                out_desc.store([off_m, off_n], total_acc.to(out_desc.dtype))
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
        it += k1 - k0


def applies(xq: torch.Tensor, qweight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel takes these tensors: contiguous 2-D e4m3 operands whose rows and bases
    are 16-byte aligned (TMA), a 16-bit output whose rows are too (N a multiple of 8)."""
    return (
        xq.dtype == FP8_DTYPE
        and qweight.dtype == FP8_DTYPE
        and xq.dim() == 2
        and qweight.dim() == 2
        and xq.shape[1] == qweight.shape[1]
        and xq.is_contiguous()
        and qweight.is_contiguous()
        and xq.shape[1] % 16 == 0
        and qweight.shape[0] % 8 == 0
        and xq.data_ptr() % 16 == 0
        and qweight.data_ptr() % 16 == 0
        and out_dtype in (torch.bfloat16, torch.float16)
    )


def fp8_gemm(
    xq: torch.Tensor,  # fp8 [M, K]
    x_scales: torch.Tensor,  # fp32 [M, 1] or [M]
    qweight: torch.Tensor,  # fp8 [N, K]
    w_scales: torch.Tensor,  # fp32 [N] (a per-tensor scale spread over the rows)
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N]
    """``warmup=True`` compiles without launching (in parallel under
    ``triton.AsyncCompileMode``)."""
    check_device(xq, qweight)
    if not applies(xq, qweight, out_dtype):
        raise ValueError(
            f"fp8_gemm: x {tuple(xq.shape)} {xq.dtype}, weight {tuple(qweight.shape)} "
            f"{qweight.dtype} (contiguous e4m3, K a multiple of 16, N of 8), out {out_dtype}"
        )
    m, k = xq.shape
    n = qweight.shape[0]
    if w_scales.numel() != n:
        w_scales = w_scales.float().expand(n)
    w_scales = w_scales.float().contiguous()
    x_scales = x_scales.reshape(m).float().contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    c = config
    x_desc = TensorDescriptor.from_tensor(xq, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(qweight, [c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    b = bias if bias is not None else w_scales
    num_tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if c.split_k > 1 and c.persistent != STREAM_K:
        if num_tiles > MAX_SPLIT_TILES:
            raise ValueError(
                f"fp8_gemm: split-K over {num_tiles} tiles (at most {MAX_SPLIT_TILES})"
            )
        parts = torch.empty(c.split_k, m, n, dtype=torch.float32, device=xq.device)
        grid = (num_tiles, c.split_k)
        launch = _fp8_gemm_split_kernel.warmup if warmup else _fp8_gemm_split_kernel[grid]
        launch(
            x_desc, w_desc, out_desc, x_scales, w_scales, b, parts, _locks(xq.device), m, n, k,
            c.split_k, HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages,
            **({"grid": grid} if warmup else {}),
        )  # fmt: skip
        return out
    if c.persistent == STREAM_K:
        k_tiles = triton.cdiv(k, c.block_k)
        programs = min(num_sms(xq.device), num_tiles * k_tiles)
        per = (num_tiles * k_tiles) // programs  # iterations a program takes, at least
        max_parts = triton.cdiv(k_tiles - 1, per) + 1  # programs a tile can be shared by
        if num_tiles > MAX_SPLIT_TILES:
            raise ValueError(f"fp8_gemm: stream-K over {num_tiles} tiles")
        parts = torch.empty(num_tiles * max_parts * c.block_m * c.block_n, dtype=torch.float32,
                            device=xq.device)  # fmt: skip
        launch = _fp8_gemm_streamk_kernel.warmup if warmup else _fp8_gemm_streamk_kernel[
            (programs,)]  # fmt: skip
        launch(
            x_desc, w_desc, out_desc, x_scales, w_scales, b, parts, _locks(xq.device), m, n, k,
            max_parts, HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, GROUP_M=c.group_m, num_warps=c.num_warps,
            num_stages=c.num_stages, **({"grid": (programs,)} if warmup else {}),
        )  # fmt: skip
        return out
    programs = min(num_tiles, num_sms(xq.device)) if c.persistent else num_tiles
    launch = _fp8_gemm_kernel.warmup if warmup else _fp8_gemm_kernel[(programs,)]
    launch(
        x_desc, w_desc, out_desc, x_scales, w_scales, b, m, n, k, programs,
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=c.group_m, FLATTEN=c.persistent >= 1, WARP_SPEC=c.persistent == 2,
        num_warps=c.num_warps, num_stages=c.num_stages,
        **({"grid": (programs,)} if warmup else {}),
    )  # fmt: skip
    return out


def fp8_gemm_ref(
    xq: torch.Tensor,  # fp8 [M, K]
    x_scales: torch.Tensor,  # fp32 [M, 1]
    qweight: torch.Tensor,  # fp8 [N, K]
    w_scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """fp32 products and sums, both scales on the sum, the bias, one rounding."""
    out = (xq.float() @ qweight.float().T) * x_scales.reshape(-1, 1) * w_scales.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
