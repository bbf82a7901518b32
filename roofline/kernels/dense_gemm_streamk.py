"""Stream-K schedule of the descriptor dense GEMM (``dense_gemm.py``, ``persistent=3``): one
program per SM; whole output tiles for all but the last one or two waves, then the remaining
tiles' K iterations shared out evenly.

When the output tiles do not divide into whole waves (Llama-3.1-8B's gate_up at 256 rows has 224
tiles of 128 x 256 for 132 SMs: 1.7 waves), the last wave leaves SMs idle. Here the first
``(T // P - 1) * P`` tiles (``T`` tiles, ``P`` programs; all of them when ``P`` divides ``T``)
run whole, one per program per round (data-parallel); the rest, between ``P`` and ``2P`` tiles,
are cut into ``rest * k_tiles`` K iterations and program ``p`` takes iterations
``[p * total // P, (p + 1) * total // P)``: every program ends at about the same time. A tile
whose iterations span several programs is finished by fix-up: each program stores its fp32
partial tile in its own workspace slot (slot 0: the first tile of its range, slot 1: the last)
and counts its arrival on the tile's counter; the last to arrive sums the partials in program
order (deterministic), stores the tile and resets the counter (graph replays find it at zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit(do_not_specialize=["M", "num_programs"])
def _dense_gemm_streamk_kernel(
    x_desc,  # [M, K] boxes [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] boxes [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N] boxes [BLOCK_M, BLOCK_N]
    ws_ptr,  # fp32 [num_programs, 2, BLOCK_M * BLOCK_N] partial tiles
    lock_ptr,  # int32 [>= 2 * num_programs] arrival counters, zero between launches
    M,
    N,
    K,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    dp_tiles = num_tiles
    if num_tiles % num_programs != 0:
        dp_tiles = max(num_tiles // num_programs - 1, 0) * num_programs
    for tile in range(pid, dp_tiles, num_programs):  # whole tiles
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(a, b.T, acc)
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))
    # the rest: K iterations shared out evenly
    total = (num_tiles - dp_tiles) * k_tiles
    start = (pid * total) // num_programs
    end = ((pid + 1) * total) // num_programs
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_ws = offs_m[:, None] * BLOCK_N + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    it = start
    while it < end:
        sk_tile = it // k_tiles
        k0 = it % k_tiles
        k1 = min(k_tiles, k0 + (end - it))
        pid_m, pid_n = _tile_coords(dp_tiles + sk_tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k0, k1):
            a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if (k0 == 0) & (k1 == k_tiles):  # the whole tile here
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))
        else:
            slot = tl.where(it == start, 0, 1)
            tl.store(ws_ptr + (pid * 2 + slot) * (BLOCK_M * BLOCK_N) + offs_ws, acc)
            tl.debug_barrier()  # every thread's partial sums are written
            # programs holding iterations of this tile: owner(i) = ceil((i + 1) P / total) - 1
            first_it = sk_tile * k_tiles
            p_first = ((first_it + 1) * num_programs + total - 1) // total - 1
            p_last = ((first_it + k_tiles) * num_programs + total - 1) // total - 1
            arrived = tl.atomic_add(lock_ptr + sk_tile, 1, sem="acq_rel", scope="gpu")
            if arrived == p_last - p_first:  # the last to arrive sums them in program order
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in range(p_first, p_last + 1):
                    p_slot = tl.where((p * total) // num_programs >= first_it, 0, 1)
                    part = ws_ptr + (p * 2 + p_slot) * (BLOCK_M * BLOCK_N) + offs_ws
                    acc += tl.load(part, cache_modifier=".cg")  # L2, never a stale L1 line
                out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))
                tl.atomic_xchg(lock_ptr + sk_tile, 0)
        it += k1 - k0


def launch_streamk(x_desc, w_desc, out_desc, m: int, n: int, k: int, config, programs: int,
                   locks: torch.Tensor, device: torch.device) -> None:  # fmt: skip
    """Run the stream-K schedule over ``programs`` programs (``dense_gemm`` builds the
    descriptors and the counters, at least ``2 * programs`` of them)."""
    c = config
    ws = torch.empty(programs, 2, c.block_m * c.block_n, dtype=torch.float32, device=device)
    _dense_gemm_streamk_kernel[(programs,)](
        x_desc, w_desc, out_desc, ws, locks, m, n, k, programs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip


def streamk_programs(num_tiles: int, k_tiles: int, num_sms: int) -> int:
    """Programs of a stream-K launch: one per SM, fewer when there are fewer K iterations to
    share (every program must hold at least one)."""
    return max(1, min(num_sms, num_tiles * k_tiles))
