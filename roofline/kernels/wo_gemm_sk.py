"""The persistent stream-K form of the Hopper swap-AB weight-only GEMM (Gluon):
``kernels.wo_gemm_ws``'s warp-specialized program (one loader warp, two consumer warpgroups of 64
weight rows each, the weight widened in registers into register-A ``wgmma``), launched once per
SM, each program walking its share of the whole problem instead of one output tile.

Why: at a few hundred rows of x the output has few tiles. Llama-3.1-8B's down projection at 256
rows is 64 tiles of 128 x 128 (and 32 at 128 rows) on 132 SMs: one tile per program leaves half
the SMs idle, and split-K pays a partial sum for every tile. Here the problem is cut into *units*
(one output tile x one ``BLOCK_K`` slice of K):

* the first ``dp_tiles`` tiles (a multiple of the program count, see ``schedule``) are dealt
  whole, round robin;
* the units of the other tiles are split evenly: program ``p`` takes units ``[p U // P,
  (p + 1) U // P)``, which may start and end inside a tile. A tile covered whole is stored at
  once. A tile's *later* parts come first in their programs' ranges: each leaves its fp32
  partial in its program's slot and counts itself on the tile's counter (release). The tile's
  *first* part is the last segment of its program: that program waits until the counter shows
  every later part (normally long done), adds them in program order to its own, scales, stores
  and zeroes the counter. Deterministic, one launch, replayable in CUDA graphs
  (``last_program.stream_counters``); every program must be resident at once (the grid is at
  most the SM count), since a first part waits for later ones.

The loader and both consumers walk the same list, so the TMA ring runs on across tiles. A tile
of 256 rows of x is two halves of 128, each its own accumulator fed by the same widened weight
tile (one 64 x 256 accumulator spills in the epilogue; two 128-row tiles of one weight block run
far apart in time and read it twice). What the H100 measured (``wo_gemm_configs``): the down
projections at 128-512 rows and most shapes at 512 gain; qkv and o at 256 rows do not (stream-K
runs its units at about 3/4 of the dealt form's rate per SM there: ``docs/architecture.md``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from roofline.kernels import num_sms
from roofline.kernels.last_program import stream_counters
from roofline.kernels.wo_gemm import (
    MAX_TILES,
    WoConfig,
    _group_scales,
    _widen,
    a_layout_bytes,
    kind_and_descriptors,
    q_row_bytes,
    scale_args,
)


def schedule(tiles: int, k_tiles: int, programs: int) -> tuple[int, int]:
    """(programs, dp_tiles): at most one program per unit; the tiles dealt whole are the largest
    multiple of the program count that leaves at least one full round of tiles to split (none
    when the tiles fill the programs evenly)."""
    units = tiles * k_tiles
    programs = max(1, min(programs, units))
    if tiles % programs == 0:
        return programs, tiles
    rounds = tiles // programs
    return programs, max(0, rounds - 1) * programs


def segments(tiles: int, k_tiles: int, programs: int, pid: int) -> list[tuple[int, int, int]]:
    """(tile, first K tile, end K tile) that program ``pid`` computes, in order: the plain-Python
    mirror of the kernel's walk (the tests check the schedule and the protocol with it)."""
    programs, dp = schedule(tiles, k_tiles, programs)
    out = [(t, 0, k_tiles) for t in range(pid, dp, programs)]
    units = (tiles - dp) * k_tiles
    u, end = (pid * units) // programs, ((pid + 1) * units) // programs
    while u < end:
        t = u // k_tiles
        k0 = u - t * k_tiles
        k1 = min(k_tiles, k0 + end - u)
        out.append((dp + t, k0, k1))
        u += k1 - k0
    return out


def owner(unit: int, programs: int, units: int) -> int:
    """The program whose stream-K range holds ``unit`` (ranges start at ``p units // programs``)."""
    return ((unit + 1) * programs + units - 1) // units - 1


@gluon.jit
def _owner(u, P, U):
    return ((u + 1) * P + U - 1) // U - 1


@gluon.jit
def _tile_offsets(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):  # fmt: skip
    per_group = GROUP_M * num_pid_n
    first_m = (t // per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _load(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, k1, c,
          BLOCK_K: gl.constexpr, QK: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """K tiles ``k0 .. k1 - 1`` of one output tile into the ring; ``c`` counts ring uses."""
    tile_bytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes
    for kk in range(k0, k1):
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) + 1) & 1, pred=c >= STAGES)
        mbarrier.expect(ready.index(s), tile_bytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, kk * BLOCK_K], ready.index(s),
                                        x_smem.index(s))  # fmt: skip
        tma.async_copy_global_to_shared(q_desc, [off_n, kk * QK], ready.index(s), q_smem.index(s))
        c += 1
    return c


@gluon.jit
def _loader(x_desc, q_desc, x_smem, q_smem, ready, empty, pid, P, dp_tiles, sk_start, sk_end,
            k_tiles, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, QK: gl.constexpr,
            STAGES: gl.constexpr):  # fmt: skip
    c = 0
    for t in range(pid, dp_tiles, P):
        off_m, off_n = _tile_offsets(t, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        c = _load(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, 0, k_tiles, c,
                  BLOCK_K, QK, STAGES)  # fmt: skip
    u = sk_start
    while u < sk_end:
        t = u // k_tiles
        k0 = u - t * k_tiles
        k1 = gl.minimum(k_tiles, k0 + sk_end - u)
        off_m, off_n = _tile_offsets(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M, BLOCK_M,
                                     BLOCK_N)  # fmt: skip
        c = _load(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, k1, c,
                  BLOCK_K, QK, STAGES)  # fmt: skip
        u += k1 - k0


@gluon.jit
def _mma_widened(x_smem, q_smem, ready, empty, s_ptr, o_ptr, rows_n, rows_b, stride_s, stride_g,
                 k0, k1, c, acc, acc1, a_layout: gl.constexpr, WG: gl.constexpr, KIND: gl.constexpr,
                 GROUP: gl.constexpr, HALVES: gl.constexpr, BLOCK_K: gl.constexpr,
                 STAGES: gl.constexpr):  # fmt: skip
    """``wo_gemm_ws``'s consumer loop (kept apart there: its SASS is the measured one) for one
    consumer warpgroup over tiles ``k0 .. k1 - 1`` of the ring (``c`` counts ring uses): tile
    k + 1 is widened while tile k's MMAs run, and every MMA retires before an A register is
    written again. ``HALVES`` 2: x's stage holds two halves of rows, each with its own
    accumulator (``acc1``; 1: ``acc1`` is not touched), fed by the same widened tile."""
    HM: gl.constexpr = acc.shape[1]
    last = k1 - 1
    span, base = _group_scales(
        s_ptr, o_ptr, rows_n, rows_b, k0, stride_s, stride_g, KIND, GROUP, BLOCK_K
    )
    s0 = c % STAGES
    mbarrier.wait(ready.index(s0), (c // STAGES) & 1)
    DT: gl.constexpr = x_smem.dtype  # bf16 or fp16
    w = _widen(q_smem.index(s0).slice(WG * 64, 64), span, base, a_layout, KIND, 64, BLOCK_K, DT)
    span, base = _group_scales(s_ptr, o_ptr, rows_n, rows_b, gl.minimum(k0 + 1, last), stride_s,
                               stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
    for kk in range(k0, k1):
        s = c % STAGES
        cn = c + 1
        sn = cn % STAGES
        span2, base2 = _group_scales(s_ptr, o_ptr, rows_n, rows_b, gl.minimum(kk + 2, last),
                                     stride_s, stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
        # (after the last tile: a stage not awaited, widened and dropped)
        mbarrier.wait(ready.index(sn), (cn // STAGES) & 1, pred=kk < last)
        if HALVES == 2:
            xs = x_smem.index(s)
            acc = warpgroup_mma(w, xs.slice(0, HM).permute((1, 0)), acc, is_async=True)
            acc1 = warpgroup_mma(w, xs.slice(HM, HM).permute((1, 0)), acc1, is_async=True)
        else:
            acc = warpgroup_mma(w, x_smem.index(s).permute((1, 0)), acc, is_async=True)
        w_next = _widen(q_smem.index(sn).slice(WG * 64, 64), span, base, a_layout, KIND, 64,
                        BLOCK_K, DT)  # fmt: skip
        span = span2
        base = base2
        if HALVES == 2:
            acc, acc1, w, w_next = warpgroup_mma_wait(num_outstanding=0,
                                                      deps=[acc, acc1, w, w_next])  # fmt: skip
        else:
            acc, w, w_next = warpgroup_mma_wait(num_outstanding=0, deps=[acc, w, w_next])
        mbarrier.arrive(empty.index(s))  # this warpgroup is done with stage s
        w = w_next
        c = cn
    return acc, acc1, c


@gluon.jit
def _half_out(acc, off_m, h, offs_n, s_ptr, bias_ptr, out_ptr, M, N, stride_om,
              out_layout: gl.constexpr, KIND: gl.constexpr, HAS_BIAS: gl.constexpr,
              HM: gl.constexpr):  # fmt: skip
    """A whole tile's half ``h``: scaled and stored."""
    res = gl.convert_layout(acc, out_layout)
    offs_m = off_m + h * HM + gl.arange(0, HM, layout=gl.SliceLayout(0, out_layout))
    _finish(res, s_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, KIND, HAS_BIAS)


@gluon.jit
def _half_offsets(h, WG: gl.constexpr, HALVES: gl.constexpr, HM: gl.constexpr,
                  out_layout: gl.constexpr):  # fmt: skip
    """Offsets of warpgroup WG's half ``h`` in a slot (``[HM, 64]`` transposed: the threads'
    consecutive rows are consecutive addresses, as in out_layout)."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    col = gl.arange(0, HM, layout=gl.SliceLayout(0, out_layout))
    return ((WG * HALVES + h) * HM + col[None, :]) * 64 + r[:, None]


@gluon.jit
def _half_save(acc, slot, h, WG: gl.constexpr, HALVES: gl.constexpr, HM: gl.constexpr,
               out_layout: gl.constexpr):  # fmt: skip
    """A later part's half ``h`` into its slot."""
    res = gl.convert_layout(acc, out_layout)
    gl.store(slot + _half_offsets(h, WG, HALVES, HM, out_layout), res)


@gluon.jit
def _half_sum(acc, ws_ptr, first, final, off_m, h, offs_n, s_ptr, bias_ptr, out_ptr, M, N,
              stride_om, TILE: gl.constexpr, WG: gl.constexpr, HALVES: gl.constexpr,
              HM: gl.constexpr, out_layout: gl.constexpr, KIND: gl.constexpr,
              HAS_BIAS: gl.constexpr):  # fmt: skip
    """A first part's half ``h`` plus the later parts' (program order), scaled and stored."""
    res = gl.convert_layout(acc, out_layout)
    offs_t = _half_offsets(h, WG, HALVES, HM, out_layout)
    for q in range(first + 1, final + 1):
        res += gl.load(ws_ptr + q.to(gl.int64) * TILE + offs_t, cache_modifier=".cg")
    offs_m = off_m + h * HM + gl.arange(0, HM, layout=gl.SliceLayout(0, out_layout))
    _finish(res, s_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, KIND, HAS_BIAS)


@gluon.jit
def _finish(res, s_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, KIND: gl.constexpr,
            HAS_BIAS: gl.constexpr):  # fmt: skip
    n_ok = offs_n < N
    if (KIND == 0) | (KIND == 3):  # row scales (int8, fp8)
        res = res * gl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    if HAS_BIAS:
        res += gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    mask = n_ok[:, None] & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_om + offs_n[:, None]
    gl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer(x_smem, q_smem, ready, empty, s_ptr, o_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
              M, N, pid, P, dp_tiles, sk_start, sk_end, sk_units, k_tiles, num_pid_m, num_pid_n,
              stride_s, stride_g, stride_om, WG: gl.constexpr, KIND: gl.constexpr,
              GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup: rows ``64 WG .. 64 WG + 63`` of every tile of the program's list; a tile of
    256 rows of x is two halves of 128 (``HALVES``), each its own accumulator."""
    HALVES: gl.constexpr = 2 if BLOCK_M > 128 else 1
    HM: gl.constexpr = BLOCK_M // HALVES
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])  # along N
    TILE: gl.constexpr = BLOCK_N * BLOCK_M
    c = 0
    n_dp = gl.cdiv(gl.maximum(dp_tiles - pid, 0), P)  # the dealt tiles, then the stream-K range
    u = sk_start
    item = 0
    while (item < n_dp) | (u < sk_end):
        if item < n_dp:
            tile = pid + item * P
            t_sk = 0
            k0 = 0
            k1 = k_tiles
        else:
            t_sk = u // k_tiles
            tile = dp_tiles + t_sk
            k0 = u - t_sk * k_tiles
            k1 = gl.minimum(k_tiles, k0 + sk_end - u)
        off_m, off_n = _tile_offsets(tile, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        row0 = off_n + WG * 64
        acc = gl.zeros([64, HM], gl.float32, acc_layout)
        rows_n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
        rows_n = gl.minimum(rows_n, N - 1).to(gl.int64)
        rows_b = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout_bytes(a_layout)))
        rows_b = gl.minimum(rows_b, N - 1).to(gl.int64)
        if HALVES == 2:
            acc1 = gl.zeros([64, HM], gl.float32, acc_layout)
            acc, acc1, c = _mma_widened(x_smem, q_smem, ready, empty, s_ptr, o_ptr, rows_n, rows_b,
                                        stride_s, stride_g, k0, k1, c, acc, acc1, a_layout, WG,
                                        KIND, GROUP, 2, BLOCK_K, STAGES)  # fmt: skip
        else:
            acc, _, c = _mma_widened(x_smem, q_smem, ready, empty, s_ptr, o_ptr, rows_n, rows_b,
                                     stride_s, stride_g, k0, k1, c, acc, acc, a_layout, WG, KIND,
                                     GROUP, 1, BLOCK_K, STAGES)  # fmt: skip
        offs_n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
        if (k0 == 0) & (k1 == k_tiles):
            _half_out(acc, off_m, 0, offs_n, s_ptr, bias_ptr, out_ptr, M, N, stride_om,
                      out_layout, KIND, HAS_BIAS, HM)  # fmt: skip
            if HALVES == 2:
                _half_out(acc1, off_m, 1, offs_n, s_ptr, bias_ptr, out_ptr, M, N, stride_om,
                          out_layout, KIND, HAS_BIAS, HM)  # fmt: skip
        else:
            counter = lock_ptr + tile * 2 + WG
            if k0 > 0:  # a later part: into this program's slot (its first segment), then count
                slot = ws_ptr + pid.to(gl.int64) * TILE
                _half_save(acc, slot, 0, WG, HALVES, HM, out_layout)
                if HALVES == 2:
                    _half_save(acc1, slot, 1, WG, HALVES, HM, out_layout)
                gl.thread_barrier()  # the warpgroup's partial is written
                gl.atomic_add(counter, 1, sem="release", scope="gpu")
            else:  # the tile's first part (this program's last segment): add the later parts
                first = _owner(t_sk * k_tiles, P, sk_units)
                final = _owner(t_sk * k_tiles + k_tiles - 1, P, sk_units)
                # they ran at the start of their programs' ranges: normally no wait here
                while gl.atomic_add(counter, 0, sem="acquire", scope="gpu") < final - first:
                    pass
                _half_sum(acc, ws_ptr, first, final, off_m, 0, offs_n, s_ptr, bias_ptr, out_ptr,
                          M, N, stride_om, TILE, WG, HALVES, HM, out_layout, KIND,
                          HAS_BIAS)  # fmt: skip
                if HALVES == 2:
                    _half_sum(acc1, ws_ptr, first, final, off_m, 1, offs_n, s_ptr, bias_ptr,
                              out_ptr, M, N, stride_om, TILE, WG, HALVES, HM, out_layout, KIND,
                              HAS_BIAS)  # fmt: skip
                gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        if item < n_dp:
            item += 1
        else:
            u += k1 - k0


@gluon.jit(do_not_specialize=["M"])
def _wo_sk_kernel(
    x_desc, q_desc, s_ptr, o_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_s, stride_g,
    stride_om, dp_tiles,
    KIND: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    gl.static_assert(STAGES >= 2, "tile k + 1 is awaited while tile k is in flight")
    NWG: gl.constexpr = BLOCK_N // 64
    gl.static_assert(NWG == 2, "two consumer warpgroups")
    QK: gl.constexpr = q_row_bytes(KIND, BLOCK_K)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    sk_units = (num_pid_m * num_pid_n - dp_tiles) * k_tiles
    sk_start = (pid * sk_units) // P
    sk_end = ((pid + 1) * sk_units) // P

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_N, QK], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NWG)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_consumer, (x_smem, q_smem, ready, empty, s_ptr, o_ptr, bias_ptr, out_ptr, ws_ptr,
                         lock_ptr, M, N, pid, P, dp_tiles, sk_start, sk_end, sk_units, k_tiles,
                         num_pid_m, num_pid_n, stride_s, stride_g, stride_om, 0, KIND, GROUP,
                         HAS_BIAS, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
            (_consumer, (x_smem, q_smem, ready, empty, s_ptr, o_ptr, bias_ptr, out_ptr, ws_ptr,
                         lock_ptr, M, N, pid, P, dp_tiles, sk_start, sk_end, sk_units, k_tiles,
                         num_pid_m, num_pid_n, stride_s, stride_g, stride_om, 1, KIND, GROUP,
                         HAS_BIAS, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
            (_loader, (x_desc, q_desc, x_smem, q_smem, ready, empty, pid, P, dp_tiles, sk_start,
                       sk_end, k_tiles, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N,
                       BLOCK_K, QK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip


def sk_gemm(
    kind: str,
    x: torch.Tensor,  # [M, K] bf16 or fp16, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    cfg: WoConfig,
    programs: int | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """``wo_gemm.wo_gemm``'s contract (``offsets=None`` for symmetric int4), one persistent
    program per SM (or ``programs``, at most the SMs: a tile's first part waits for its later
    parts, so every program must be resident); ``cfg.block_n`` must be 128."""
    if cfg.block_n != 128 or cfg.block_m not in (64, 128, 256):
        raise ValueError(f"wo_gemm_sk: 128 weight rows and 64, 128 or 256 rows of x ({cfg})")
    m, k = x.shape
    n = qweight.shape[0]
    code, x_desc, q_desc = kind_and_descriptors(
        "wo_gemm_sk", kind, x, qweight, scales, offsets, cfg
    )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_tiles = k // cfg.block_k
    if tiles > MAX_TILES // 2:
        raise ValueError(f"wo_gemm_sk: {m} x {n} is {tiles} tiles (at most {MAX_TILES // 2})")
    grid, dp_tiles = schedule(tiles, k_tiles, min(programs or num_sms(x.device), num_sms(x.device)))
    # slot p: program p's first segment where that is a later part of a tile
    ws = torch.empty(grid, cfg.block_n * cfg.block_m, dtype=torch.float32, device=x.device)
    locks = stream_counters(x.device, MAX_TILES, "wo_gemm_sk")  # 2 per tile, zero between launches
    scales, offsets, bias_arg, stride_s, stride_g, group = scale_args(
        code, k, scales, offsets, bias
    )
    _wo_sk_kernel[(grid,)](
        x_desc, q_desc, scales, offsets, bias_arg, out, ws, locks, m, n, k, stride_s, stride_g,
        out.stride(0), dp_tiles,
        KIND=code, GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        GROUP_M=cfg.group_m, CONSUMER_REGS=224, num_warps=4,
    )  # fmt: skip
    return out
