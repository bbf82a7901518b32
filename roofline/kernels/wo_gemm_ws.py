"""The warp-specialized form of ``kernels.wo_gemm`` (Hopper, Gluon): one loader warp and
``BLOCK_N // 64`` consumer warpgroups per program, each consumer on its own 64 weight rows.

In ``wo_gemm`` every warpgroup of a program widens its next tile, then waits for its MMAs, then
meets the others at a barrier before the ring is refilled: the program's warpgroups widen at the
same time and run their MMAs at the same time, so the tensor cores idle while they widen. Here
the loader warp alone issues the TMA copies (a stage is refilled once every consumer has
released it on its ``empty`` mbarrier), and the consumers never meet: each waits only for its own
stage's ``ready`` mbarrier and its own MMAs, so their K loops drift apart and one warpgroup's
widening runs under the other's MMAs. Each consumer keeps ``wo_gemm``'s race-free order (tile k's
MMAs in flight while tile k + 1 is widened, then ``warpgroup_mma_wait(0)`` before any A register
is written again) and the same widening helpers. One K slice (no split-K).
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

from roofline.kernels.wo_gemm import (
    WoConfig,
    _group_scales,
    _widen,
    a_layout_bytes,
    kind_and_descriptors,
    q_row_bytes,
    scale_args,
)


@gluon.jit
def _loader(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, inter, k_tiles,
            BLOCK_K: gl.constexpr, QK: gl.constexpr, STAGES: gl.constexpr,
            SILU: gl.constexpr):  # fmt: skip
    """One warp: tile t into stage t % STAGES once the consumers released its last use (with
    ``SILU``, two 64-row boxes a stage: the gate rows ``off_n ..`` and the up rows ``inter +
    off_n ..``, one per consumer)."""
    if SILU:
        tile_bytes: gl.constexpr = x_desc.block_type.nbytes + 2 * q_desc.block_type.nbytes
    else:
        tile_bytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes
    for t in range(k_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) + 1) & 1, pred=t >= STAGES)
        mbarrier.expect(ready.index(s), tile_bytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, t * BLOCK_K], ready.index(s),
                                        x_smem.index(s))  # fmt: skip
        if SILU:
            tma.async_copy_global_to_shared(q_desc, [off_n, t * QK], ready.index(s),
                                            q_smem.index(2 * s))  # fmt: skip
            tma.async_copy_global_to_shared(q_desc, [inter + off_n, t * QK], ready.index(s),
                                            q_smem.index(2 * s + 1))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(q_desc, [off_n, t * QK], ready.index(s),
                                            q_smem.index(s))  # fmt: skip


@gluon.jit
def _q_rows(q_smem, s, WG: gl.constexpr, SILU: gl.constexpr):
    """This consumer's 64 weight rows of stage ``s``."""
    if SILU:
        return q_smem.index(2 * s + WG)
    else:
        return q_smem.index(s).slice(WG * 64, 64)


@gluon.jit
def _consumer(x_smem, q_smem, ready, empty, xch, xbar, s_ptr, o_ptr, bias_ptr, out_ptr, M, N,
              inter, off_m, off_n, k_tiles, stride_s, stride_g, stride_om, WG: gl.constexpr,
              KIND: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              SILU: gl.constexpr):  # fmt: skip
    """One warpgroup: weight rows ``off_n + 64 WG`` to ``+ 64`` of the program's tile (with
    ``SILU``: the gate rows ``off_n ..`` for WG 0, the up rows ``inter + off_n ..`` for WG 1)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if SILU:
        row0 = off_n + WG * inter
    else:
        row0 = off_n + WG * 64
    rows_n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
    rows_n = gl.minimum(rows_n, N - 1).to(gl.int64)
    rows_b = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout_bytes(a_layout)))
    rows_b = gl.minimum(rows_b, N - 1).to(gl.int64)
    last = k_tiles - 1
    acc = gl.zeros([64, BLOCK_M], gl.float32, acc_layout)
    span, base = _group_scales(
        s_ptr, o_ptr, rows_n, rows_b, 0, stride_s, stride_g, KIND, GROUP, BLOCK_K
    )
    mbarrier.wait(ready.index(0), 0)
    DT: gl.constexpr = x_smem.dtype  # bf16 or fp16: the widened weight's, the output's
    w = _widen(_q_rows(q_smem, 0, WG, SILU), span, base, a_layout, KIND, 64, BLOCK_K, DT)
    span, base = _group_scales(s_ptr, o_ptr, rows_n, rows_b, gl.minimum(1, last), stride_s,
                               stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
    for k in range(k_tiles):
        s = k % STAGES
        kn = k + 1
        sn = kn % STAGES
        span2, base2 = _group_scales(s_ptr, o_ptr, rows_n, rows_b, gl.minimum(k + 2, last),
                                     stride_s, stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
        mbarrier.wait(ready.index(sn), (kn // STAGES) & 1, pred=kn < k_tiles)
        acc = warpgroup_mma(w, x_smem.index(s).permute((1, 0)), acc, is_async=True)
        w_next = _widen(_q_rows(q_smem, sn, WG, SILU), span, base, a_layout, KIND, 64,
                        BLOCK_K, DT)  # fmt: skip
        span = span2
        base = base2
        # tile k's MMAs retire before any A register is written again
        acc, w, w_next = warpgroup_mma_wait(num_outstanding=0, deps=[acc, w, w_next])
        mbarrier.arrive(empty.index(s))  # this warpgroup is done with stage s
        w = w_next

    out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])  # along N
    res = gl.convert_layout(acc, out_layout)  # [64, BM]
    offs_n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    n_ok = offs_n < N
    if (KIND == 0) | (KIND == 3):  # row scales (int8, fp8)
        res = res * gl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    if HAS_BIAS:
        res += gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    if SILU:  # out[:, j] = silu(gate_j) * up_j, each rounded as the unfused GEMM stores it
        half = res.to(DT)
        if WG == 1:  # the up rows go to the gate warpgroup through shared memory
            xch.store(half)
            gl.thread_barrier()  # (this warpgroup's named barrier) every row stored
            mbarrier.arrive(xbar)
        else:
            g = half.to(gl.float32)
            # kernels/activation.py's SiLU, x / (1 + exp(-x)), with the approximate exp2 and
            # division: a different bf16 only where the fp32 value lies within a few ulp of a
            # rounding boundary (none of 73M on the H100); libdevice's expf measured 102.0
            # against 97.8 us (int8, 256 rows), the correctly rounded division spilled there.
            # Kept in x's dtype: half the registers of fp32 beside the up rows
            act = gl.fdiv(g, 1.0 + gl.exp2(g * -1.4426950408889634)).to(DT)
            mbarrier.wait(xbar, 0)
            up = xch.load(out_layout)
            cols = off_n + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
            mask = (cols < inter)[:, None] & (offs_m[None, :] < M)
            out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_om + cols[:, None]
            prod = act.to(gl.float32) * up.to(gl.float32)
            gl.store(out_ptrs, prod.to(DT), mask=mask)
    else:
        mask = n_ok[:, None] & (offs_m[None, :] < M)
        out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_om + offs_n[:, None]
        gl.store(out_ptrs, res.to(DT), mask=mask)


@gluon.jit(do_not_specialize=["M"])
def _wo_ws_kernel(
    x_desc, q_desc, s_ptr, o_ptr, bias_ptr, out_ptr, M, N, K, stride_s, stride_g, stride_om,
    KIND: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, SILU: gl.constexpr = False,
):  # fmt: skip
    """With ``SILU`` the weight is an MLP's merged ``[gate; up]`` (``N = 2 I`` rows), ``q_desc``
    has 64-row boxes, and a program owns 64 columns of ``out[M, I] = silu(gate) * up``."""
    gl.static_assert(STAGES >= 2, "tile k + 1 is awaited while tile k is in flight")
    NWG: gl.constexpr = BLOCK_N // 64
    QK: gl.constexpr = q_row_bytes(KIND, BLOCK_K)
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    if SILU:
        inter = N // 2
        num_pid_n = gl.cdiv(inter, 64)
    else:
        inter = N
        num_pid_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    off_m = pid_m * BLOCK_M
    if SILU:
        off_n = pid_n * 64
    else:
        off_n = pid_n * BLOCK_N
    k_tiles = K // BLOCK_K

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    if SILU:  # one 64-row box per consumer a stage (gate, up)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * STAGES, 64, QK], q_desc.layout)
    else:
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_N, QK], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NWG)
    if SILU:  # the up warpgroup's rounded result, handed to the gate warpgroup
        xch = gl.allocate_shared_memory(
            x_desc.dtype, [64, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1])
        )  # rows contiguous: a warp of the epilogue layout touches 64 consecutive rows
        xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(xbar, count=1)
    else:
        xch = ready  # (not used)
        xbar = ready
    fence_async_shared()

    # (the partitions' arguments are spelled out: constexprs in a tuple variable decay)
    gl.static_assert(NWG == 2, "two consumer warpgroups (four spill)")
    gl.warp_specialize(
        [
            (_consumer, (x_smem, q_smem, ready, empty, xch, xbar, s_ptr, o_ptr, bias_ptr,
                         out_ptr, M, N, inter, off_m, off_n, k_tiles, stride_s, stride_g,
                         stride_om, 0, KIND, GROUP, HAS_BIAS, BLOCK_M, BLOCK_K, STAGES, SILU)),
            (_consumer, (x_smem, q_smem, ready, empty, xch, xbar, s_ptr, o_ptr, bias_ptr,
                         out_ptr, M, N, inter, off_m, off_n, k_tiles, stride_s, stride_g,
                         stride_om, 1, KIND, GROUP, HAS_BIAS, BLOCK_M, BLOCK_K, STAGES, SILU)),
            (_loader, (x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, inter,
                       k_tiles, BLOCK_K, QK, STAGES, SILU)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip


def wo_gemm_ws(
    kind: str,
    x: torch.Tensor,  # [M, K] bf16 or fp16, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    cfg: WoConfig,
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N] of x's dtype ([M, N / 2] with silu_mul)
    """``wo_gemm.wo_gemm``'s contract (``offsets=None`` for symmetric int4), warp-specialized;
    ``cfg.split_k`` must be 1 and ``cfg.block_n`` 128 (two consumer warpgroups; four spill at the
    120 registers a thread that 17 warps leave). ``silu_mul``: the weight is an MLP's merged
    ``[gate; up]`` (N even) and the result ``silu(x W_gate^T) * (x W_up^T)``, each product
    rounded to x's dtype first as the unfused GEMM stores it, then ``kernels/activation.py``'s
    arithmetic: the unfused pair's values, without the ``[M, N]`` product in memory."""
    if cfg.split_k != 1 or cfg.block_n != 128:
        raise ValueError(f"wo_gemm_ws: no split-K, 128 weight rows ({cfg})")
    m, k = x.shape
    n = qweight.shape[0]
    if silu_mul and n % 2:
        raise ValueError(f"wo_gemm_ws: silu_mul needs [gate; up] rows, got {n}")
    code, x_desc, q_desc = kind_and_descriptors(
        "wo_gemm_ws", kind, x, qweight, scales, offsets,
        cfg._replace(block_n=64) if silu_mul else cfg,
    )  # fmt: skip
    cols = n // 2 if silu_mul else n
    out = torch.empty(m, cols, dtype=x.dtype, device=x.device)
    scales, offsets, bias_arg, stride_s, stride_g, group = scale_args(
        code, k, scales, offsets, bias
    )
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(cols, 64 if silu_mul else cfg.block_n)
    regs = 224  # per consumer thread (setmaxnreg; the loader warp keeps 24)
    _wo_ws_kernel[(tiles,)](
        x_desc, q_desc, scales, offsets, bias_arg, out, m, n, k, stride_s, stride_g, out.stride(0),
        KIND=code, GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        GROUP_M=cfg.group_m, CONSUMER_REGS=regs, SILU=silu_mul,
        num_warps=4,
    )  # fmt: skip
    return out
