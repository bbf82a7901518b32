"""Dense 16-bit GEMM ``out[M, N] = x[M, K] @ w[N, K]^T`` through tensor descriptors (TMA on
Hopper), for the row counts where cuBLAS's own choice is measured slow (``layers/gemm_rows.py``
decides; everything else stays on cuBLAS).

One program owns one ``[BLOCK_M, BLOCK_N]`` output tile at a time: x's and w's ``BLOCK_K`` boxes
come through 2-D descriptors (out-of-range rows of x read as zeros, the store clips them), meet
in the tensor cores with an fp32 accumulator, and the tile is rounded once to the output dtype.
Tiles go M-fastest within groups of ``GROUP_M`` row blocks, so the row blocks that share a
weight tile run side by side and the weight is read from HBM about once (x, at most a few MB
at the row counts this kernel serves, stays in L2). ``DenseGemmConfig.persistent``: 0 launches
one program per tile; 1 launches one program per SM walking the tiles with a flattened loop
(the next tile's loads overlap this one's epilogue); 2 the same loop warp-specialized (a
producer warp issues the TMA loads).

``split_k > 1`` (few output tiles, long K: the decode-sized row counts) gives each program one
slice of K (slices differ by one K tile at most); its fp32 partial tile goes to a workspace, and
the tile's last slice to arrive (an acq_rel atomic counts arrivals) sums all slices in slice
order, stores the tile and resets its counter: one launch, deterministic, replayable in graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels import check_device, num_sms
from roofline.kernels.dense_gemm_configs import DenseGemmConfig
from roofline.kernels.last_program import stream_counters


@triton.jit
def _tile_offsets(
    tile, num_pid_m, per_group, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """(off_m, off_n) of output tile ``tile``: M-fastest within groups of ``GROUP_M`` row blocks
    (``per_group`` = ``GROUP_M`` x the column blocks)."""
    first_m = (tile // per_group) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)  # row blocks in this (maybe last) group
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _dot_k_tiles(x_desc, w_desc, off_m, off_n, k_first, k_last, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """fp32 ``x[off_m:, K tiles k_first..k_last) @ w[off_n:, same].T``: one output tile's
    (slice of the) K loop, both operands through their TMA descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_first, k_last):
        a = x_desc.load([off_m, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        b = w_desc.load([off_n, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit(do_not_specialize=["M", "num_programs"])
def _dense_gemm_kernel(
    x_desc,  # [M, K] boxes [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] boxes [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N] boxes [BLOCK_M, BLOCK_N]
    M,
    N,
    K,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_pid_n
    for tile in tl.range(
        tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPEC
    ):
        off_m, off_n = _tile_offsets(tile, num_pid_m, per_group, GROUP_M, BLOCK_M, BLOCK_N)
        acc = _dot_k_tiles(x_desc, w_desc, off_m, off_n, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit
def _split_k_partial(
    x_desc, w_desc, part_ptr, lock_ptr, tile, part, split_k, off_m, off_n, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Split-K slice ``part`` of output tile ``tile`` (at ``off_m``, ``off_n``): its fp32 partial
    sums stored in ``part_ptr`` ([split_k, M, N]), then its arrival counted at ``lock_ptr``.
    Returns (whether it arrived last, offs_m, offs_n, offs, mask, slice_size)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = (part * k_tiles) // split_k  # slice s: K tiles [s kt / S, (s + 1) kt / S)
    k_last = ((part + 1) * k_tiles) // split_k
    acc = _dot_k_tiles(x_desc, w_desc, off_m, off_n, k_first, k_last, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # [BLOCK_M, BLOCK_N]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    slice_size = M.to(tl.int64) * N
    tl.store(part_ptr + part * slice_size + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial sums are written
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return arrived == split_k - 1, offs_m, offs_n, offs, mask, slice_size


@triton.jit
def _split_k_total(part_ptr, offs, mask, slice_size, split_k, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """The sum of the ``split_k`` partial tiles, in slice order."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(split_k):  # .cg: from L2, never a stale L1 line
        total += tl.load(part_ptr + s * slice_size + offs, mask=mask, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
    return total


@triton.jit(do_not_specialize=["M", "split_k"])
def _dense_gemm_split_kernel(
    x_desc,  # [M, K] boxes [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] boxes [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N] boxes [BLOCK_M, BLOCK_N]
    ws_ptr,  # fp32 [split_k, M, N] partial tiles
    lock_ptr,  # int32 [tiles] arrival counters, zero between launches
    M,
    N,
    K,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    off_m, off_n = _tile_offsets(tile, num_pid_m, per_group, GROUP_M, BLOCK_M, BLOCK_N)
    last, offs_m, offs_n, offs, mask, slice_size = _split_k_partial(
        x_desc, w_desc, ws_ptr, lock_ptr, tile, part, split_k, off_m, off_n, M, N, K,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if last:  # the last slice to finish sums them all, in slice order
        total = _split_k_total(ws_ptr, offs, mask, slice_size, split_k, BLOCK_M, BLOCK_N)
        out_desc.store([off_m, off_n], total.to(out_desc.dtype))
        tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch (graph replays)


MAX_SPLIT_TILES = 1 << 14
"""Output tiles a split-K launch may have (its arrival counters)."""


def _locks(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of ``device``'s current stream (``last_program``; this
    module's and ``fp8_gemm``'s launches of one stream run one after another and each leaves
    its counters at zero)."""
    return stream_counters(device, MAX_SPLIT_TILES, "dense_gemm")


def dense_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: 2-D 16-bit x and weight of one dtype, both
    contiguous with 16-byte aligned rows and bases (what the descriptors need)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[1] == weight.shape[1]
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[1] % 8 == 0
        and weight.shape[0] % 8 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def dense_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    config: DenseGemmConfig,
    out: torch.Tensor | None = None,  # [M, N]
    num_programs: int | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T`` with the tiles of ``config`` (see ``dense_gemm_applies``);
    ``num_programs``: of a persistent launch (default one per SM; tests take fewer)."""
    check_device(x, weight)
    if not dense_gemm_applies(x, weight):
        raise ValueError(
            f"dense_gemm needs contiguous 16-bit x {tuple(x.shape)} / weight "
            f"{tuple(weight.shape)} of one dtype, K and N multiples of 8"
        )
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = config
    x_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    num_tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if c.split_k > 1:
        if num_tiles > MAX_SPLIT_TILES:
            raise ValueError(f"split-K over {num_tiles} tiles (at most {MAX_SPLIT_TILES})")
        ws = torch.empty(c.split_k, m, n, dtype=torch.float32, device=x.device)
        _dense_gemm_split_kernel[(num_tiles, c.split_k)](
            x_desc, w_desc, out_desc, ws, _locks(x.device), m, n, k, c.split_k,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
        return out
    programs = min(num_tiles, num_programs or num_sms(x.device)) if c.persistent else num_tiles
    _dense_gemm_kernel[(programs,)](
        x_desc, w_desc, out_desc, m, n, k, programs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=c.group_m, FLATTEN=c.persistent >= 1, WARP_SPEC=c.persistent == 2,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


def dense_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What ``dense_gemm`` computes: fp32 products and sums, rounded once to x's dtype."""
    return (x.float() @ weight.float().T).to(x.dtype)
