"""The Triton launches of a step whose long fresh segments went to SDPA (``sdpa_prefill.py``):
one per run of consecutive requests left over, each with its own metadata.

A run's metadata is made once per step from the host lists: query starts relative to the run's
first row, and copies (fresh allocations, never views at an offset: Triton specialises a kernel on
each pointer's 16-byte alignment) of its requests' context lengths and block-table rows. Every run
launches the kernel variant the whole step would have launched (the step's GQA-packed choice, its
longest chunk for the tiles, its prefix code and gathered prefixes, ``kernels/prefix_gather.py``),
so the warm-up's variants cover it (a run of decode rows alone would otherwise pick tiles no
warm-up batch compiles: ``tests/kernels/test_sdpa_prefill.py``). q, the step's K/V rows and
``out`` are row slices (every row starts 16-byte aligned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from roofline.attention.sdpa_prefill import StepPlan
from roofline.kernels.prefix_gather import GatheredPrefix


@dataclass
class RunMetadata:
    start: int  # the run's first row in the step
    stop: int
    query_start_loc: torch.Tensor  # [n + 1] int32, relative to ``start``
    seq_lens: torch.Tensor  # [n] int32
    block_table: torch.Tensor  # [n, max_num_blocks] int32
    first: int  # the run's first request (its slice of a gathered prefix's start_loc)
    end: int
    prefix_memo: tuple[torch.Tensor, torch.Tensor] | None = None  # (step's start_loc, slice)


class StepKernel(NamedTuple):
    """The whole step's kernel choice, which every run follows."""

    packed: bool  # the GQA-packed kernel (mostly short chunks)
    max_query_len: int  # the step's longest chunk: the tiles, the step's own K/V rows
    has_prefix: bool  # a request of the step attends cached positions


def step_kernel(meta, num_heads: int, num_kv_heads: int) -> StepKernel:  # noqa: ANN001
    from roofline.kernels import prefill_attention_gqa as gqa
    from roofline.kernels.prefill_attention import has_cached_context

    packed = gqa.ENABLED and meta.max_query_len > 1
    packed = packed and gqa.applies(num_heads, num_kv_heads, meta.query_lens_cpu)
    return StepKernel(packed, meta.max_query_len, has_cached_context(meta))


def run_metadata(plan: StepPlan, meta) -> list[RunMetadata]:  # noqa: ANN001
    """Every run's metadata, uploaded once per step (no host wait: pinned, non-blocking)."""
    out = []
    for run in plan.runs:
        i0, i1 = run.first, run.end
        starts = [s - run.start for s in meta.query_start_loc_cpu[i0 : i1 + 1]]
        qsl = torch.tensor(starts, dtype=torch.int32)  # [n + 1]
        if meta.seq_lens.is_cuda:
            qsl = qsl.pin_memory().to(meta.seq_lens.device, non_blocking=True)
        out.append(RunMetadata(
            start=run.start, stop=run.stop, query_start_loc=qsl,
            seq_lens=meta.seq_lens[i0:i1].to(torch.int32, copy=True),
            block_table=meta.block_table[i0:i1].clone(), first=i0, end=i1,
        ))  # fmt: skip
    return out


def _run_prefix(rm: RunMetadata, prefix: GatheredPrefix | None) -> GatheredPrefix | None:
    """The run's slice of the step's gathered prefixes (made once per step)."""
    if prefix is None:
        return None
    if rm.prefix_memo is None or rm.prefix_memo[0] is not prefix.start_loc:
        rm.prefix_memo = (prefix.start_loc, prefix.start_loc[rm.first : rm.end].clone())
    return GatheredPrefix(prefix.k, prefix.v, rm.prefix_memo[1])


def attend_runs(
    runs: list[RunMetadata],
    kernel: StepKernel,
    q: torch.Tensor,  # [num_tokens, H, D]
    k: torch.Tensor,  # [num_tokens, Hk, D]: the step's rows, as stored
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, Hk, D]
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,  # [num_tokens, H, D]
    prefix: GatheredPrefix | None,
) -> None:
    """Each run's rows of ``out`` from the Triton kernels."""
    from roofline.attention.triton_backend import TMA_MIN_QUERY_LEN
    from roofline.kernels import prefill_attention_gqa as gqa
    from roofline.kernels.prefill_attention import prefill_attention

    step_rows = kernel.max_query_len >= TMA_MIN_QUERY_LEN
    for rm in runs:
        r0, r1 = rm.start, rm.stop
        if kernel.packed:
            gqa.prefill_attention_gqa(
                q[r0:r1], k_cache, v_cache, rm.block_table, rm.query_start_loc, rm.seq_lens,
                scale, out=out[r0:r1],
            )  # fmt: skip
            continue
        prefill_attention(
            q[r0:r1], k_cache, v_cache, rm.block_table, rm.query_start_loc, rm.seq_lens, scale,
            max_query_len=kernel.max_query_len, out=out[r0:r1],
            k_new=k[r0:r1] if step_rows else None, v_new=v[r0:r1] if step_rows else None,
            prefix=_run_prefix(rm, prefix), has_prefix=kernel.has_prefix,
        )  # fmt: skip
