"""The grouped cascade's last-program merge (``kernels/cascade_grouped.py``): each program of a
unit (``GROUP_REQS`` requests x one KV head) writes its partial (output normalised by its own
softmax sum, fp32, and its log-sum-exp, base 2) into its slot, then counts itself in on the
unit's counter (``last_program.py``: an acq_rel atomic); the program that arrives last merges
every slot of the unit's rows by log-sum-exp, stores the output and zeroes the counter for the
next launch. No merge launch, and the launch replays from a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _arrive(
    counter_ptr,
    unit,
    prefix_programs,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    unit_req0,
    kv_head,
    num_reqs,
    NUM_SLOTS: tl.constexpr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_REQS: tl.constexpr,
    MERGE_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COUNT_SUFFIX: tl.constexpr,
):
    """Count this program's partials in; the unit's last program merges (last_program.py):
    every slot of the unit's rows by log-sum-exp, ``MERGE_M`` rows at a time (the partials are
    read from L2, ``.cg``: other programs wrote them), and stores the output. A unit expects
    ``prefix_programs`` and, with ``COUNT_SUFFIX``, one suffix program per request (the last
    unit may hold fewer requests)."""
    tl.debug_barrier()  # every thread's partial stores before the release
    counter = counter_ptr + unit
    expected = prefix_programs
    if COUNT_SUFFIX:
        expected += tl.minimum(GROUP_REQS, num_reqs - unit_req0)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == expected - 1:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        for m0 in range(0, GROUP_REQS * GROUP, MERGE_M):
            offs_m = m0 + tl.arange(0, MERGE_M)
            req = unit_req0 + offs_m // GROUP  # [MERGE_M]
            heads = kv_head * GROUP + offs_m % GROUP
            ok = (offs_m < GROUP_REQS * GROUP) & (req < num_reqs)
            mask = ok[:, None] & d_mask[None, :]
            row0 = (req.to(tl.int64) * NUM_HEADS + heads) * NUM_SLOTS  # [MERGE_M]
            m = tl.full([MERGE_M], float("-inf"), dtype=tl.float32)
            den = tl.zeros([MERGE_M], dtype=tl.float32)
            num = tl.zeros([MERGE_M, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(NUM_SLOTS):  # every slot's loads at once
                lse = tl.load(
                    part_lse_ptr + row0 + j, mask=ok, other=float("-inf"), cache_modifier=".cg"
                )
                o = tl.load(
                    part_out_ptr + (row0 + j)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )  # [MERGE_M, BLOCK_D]
                m_new = tl.maximum(m, lse)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)  # 0 while nothing was summed
                w = tl.exp2(lse - m_safe)
                num = num * alpha[:, None] + o * w[:, None]
                den = den * alpha + w
                m = m_new
            o = num / tl.where(den > 0.0, den, 1.0)[:, None]
            dst = out_ptr + req.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
            tl.store(dst + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(counter, 0)  # ready for the next launch
