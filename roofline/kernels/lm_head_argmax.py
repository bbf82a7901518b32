"""The LM head and greedy argmax in one launch: ``logits = (x @ W^T).float()`` for a few rows,
and each row's argmax, without the float copy and the three reduction kernels after it.

The GEMM is ``kernels.gemv``'s skinny GEMM with the same config, loop and rounding (the result
rounded to x's dtype, then widened), so the logits have the bits of
``skinny_gemm(x, W).float()``. In its epilogue each program also takes the max of its
``BLOCK_N`` columns per row (ties to the lowest column) and stores it with its column; the last
program to finish (an atomic counter, which it resets) reduces those partials in program order,
keeping the first of equal maxima, and writes the ids: ``torch.argmax``'s answer (ties to the
lowest index) on the same logits. ``lm_head_argmax_ref`` is that sequence in torch.

As a programmatic dependent (PDL) a program prefetches its first weight lines into L2 before it
waits for the previous kernel (the final norm), as the skinny GEMM does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.gemv import SkinnyConfig, _accumulate, m_bucket, pick_config
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

REDUCE_BLOCK = 1024  # partials per step of the last program's reduction
HEAD_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {}
"""(V, K, m_bucket) -> config where this kernel beats the skinny GEMM's tuned one (else that).
The logits keep the skinny GEMM's bits only with its config (the K order of the sums)."""


def lm_head_argmax_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [V, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [M, V] fp32, ids [M] int64
    """fp32 matmul rounded once to x's dtype, widened; the first index of each row's max."""
    logits = (x.float() @ weight.float().T).to(x.dtype).float()  # [M, V]
    return logits, logits.argmax(dim=-1)


@triton.jit(do_not_specialize=["M"])
def _lm_head_argmax_kernel(
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, K], rows stride_wn apart
    logits_ptr,  # [M, N] fp32, rows stride_lm apart
    part_val_ptr,  # [BLOCK_M, num_programs] fp32: each program's max per row
    part_idx_ptr,  # [BLOCK_M, num_programs] int32: its column
    ids_ptr,  # [M] int64
    counter_ptr,  # [1] int32, zero between launches
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_lm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    REDUCE: tl.constexpr,  # partials per step of the final reduction
    PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if PDL:
        offs_l = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, K - 1)
        prefetch_l2(w_ptr + rows_n[:, None] * stride_wn + offs_l[None, :])
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if USE_DOT or BLOCK_M > 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K - K % BLOCK_K
    for _ in tl.range(0, k_main, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        acc = _accumulate(acc, tl.load(x_ptrs), w, BLOCK_M, USE_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not EVEN_K:
        mask_k = offs_k[None, :] < K - k_main
        w = tl.load(w_ptrs, mask=mask_k, other=0.0)
        acc = _accumulate(acc, tl.load(x_ptrs, mask=mask_k, other=0.0), w, BLOCK_M, USE_DOT)
    if USE_DOT or BLOCK_M > 1:
        result = acc  # [BM, BN]
    else:
        result = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    result = result.to(x_ptr.dtype.element_ty).to(tl.float32)  # skinny_gemm(...).float()
    n_ok = offs_n < N
    out_ptrs = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_lm + offs_n[None, :]
    tl.store(out_ptrs, result, mask=(offs_m[:, None] < M) & n_ok[None, :])

    masked = tl.where(n_ok[None, :], result, float("-inf"))  # [BM, BN]
    best = tl.max(masked, axis=1)  # [BM]
    col = tl.argmax(masked, axis=1, tie_break_left=True) + pid * BLOCK_N  # [BM]
    part = offs_m * num_programs + pid  # [BM]
    tl.store(part_val_ptr + part, best)
    tl.store(part_idx_ptr + part, col.to(tl.int32))
    tl.debug_barrier()  # the CTA's partials before its release (last_program.py)
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_programs - 1:  # the last program: reduce the partials in program order
        offs_p = tl.arange(0, REDUCE)
        top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        top_prog = tl.zeros([BLOCK_M], dtype=tl.int32)
        for p0 in range(0, num_programs, REDUCE):
            progs = p0 + offs_p  # [R]
            vals = tl.load(part_val_ptr + offs_m[:, None] * num_programs + progs[None, :],
                           mask=progs[None, :] < num_programs, other=float("-inf"),
                           cache_modifier=".cg")  # fmt: skip
            step_best = tl.max(vals, axis=1)  # [BM]
            step_prog = tl.argmax(vals, axis=1, tie_break_left=True) + p0
            better = step_best > top  # strictly: the earlier program keeps a tie
            top_prog = tl.where(better, step_prog, top_prog)
            top = tl.where(better, step_best, top)
        ids = tl.load(part_idx_ptr + offs_m * num_programs + top_prog, cache_modifier=".cg")
        tl.store(ids_ptr + offs_m, ids.to(tl.int64), mask=offs_m < M)
        tl.store(counter_ptr, 0)  # ready for the next launch


def lm_head_argmax(
    x: torch.Tensor,  # [M, K] 16-bit, rows contiguous, M <= 16
    weight: torch.Tensor,  # [V, K] in x's dtype, rows contiguous
    logits: torch.Tensor | None = None,  # [M, V] fp32
    ids: torch.Tensor | None = None,  # [M] int64
    config: SkinnyConfig | None = None,  # sweeps; default: HEAD_CONFIGS, else the skinny GEMM's
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [M, V] fp32, ids [M] int64)
    """``skinny_gemm(x, weight).float()`` and its row-wise ``argmax`` in one launch."""
    check_device(x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"lm_head_argmax: x {tuple(x.shape)} {x.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not match")  # fmt: skip
    if not 1 <= m <= 16 or n == 0 or k == 0:
        raise ValueError(f"lm_head_argmax takes 1 to 16 rows and a non-empty weight, got {m}")
    if logits is None:
        logits = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if ids is None:
        ids = torch.empty(m, dtype=torch.int64, device=x.device)
    block_m = m_bucket(m)
    cfg = config or HEAD_CONFIGS.get((n, k, block_m)) or pick_config(m, n, k, x.device)
    num_programs = triton.cdiv(n, cfg.block_n)
    part_val = torch.empty(block_m, num_programs, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(block_m, num_programs, dtype=torch.int32, device=x.device)
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    line_elems = 128 // weight.element_size()
    lines = min(triton.cdiv(k, line_elems), max(1, 16384 // (128 * cfg.block_n)))
    meta: dict = {"launch_pdl": True} if pdl else {}
    counter = counters(x.device, 1, "lm_head_argmax")
    _lm_head_argmax_kernel[(num_programs,)](
        x, weight, logits, part_val, part_idx, ids, counter, m, n, k,
        x.stride(0), weight.stride(0), logits.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        USE_DOT=cfg.use_dot and x.dtype != torch.float32, EVEN_K=k % cfg.block_k == 0,
        REDUCE=min(REDUCE_BLOCK, triton.next_power_of_2(num_programs)), PDL=pdl,
        PREFETCH_LINES=triton.next_power_of_2(lines) if pdl else 1,
        LINE_ELEMS=line_elems, num_warps=cfg.num_warps, **meta,
    )  # fmt: skip
    return logits, ids
