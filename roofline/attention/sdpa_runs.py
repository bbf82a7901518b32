"""The Triton launches of a step whose long fresh segments went to SDPA (``sdpa_prefill.py``):
one per run of consecutive requests left over, each with its own metadata.

A run's metadata is made once per step from the host lists: query starts relative to the run's
first row, and copies (fresh allocations, never views at an offset: Triton specialises a kernel on
each pointer's 16-byte alignment) of its requests' context lengths and block-table rows. The run
then takes the kernel the whole step would have chosen for requests like its own: the GQA-packed
kernel for mostly short chunks, else ``prefill_attention`` (the descriptor kernel once a chunk is
long enough, with the step's gathered prefixes, ``kernels/prefix_gather.py``). q, the step's K/V
rows and ``out`` are row slices (every row starts 16-byte aligned).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    max_query_len: int
    has_prefix: bool  # a request of the run attends cached positions
    packed: bool  # the GQA-packed kernel (mostly short chunks)
    first: int  # the run's first request (its slice of a gathered prefix's start_loc)
    end: int
    prefix_memo: tuple[torch.Tensor, torch.Tensor] | None = None  # (step's start_loc, slice)


def run_metadata(plan: StepPlan, meta, num_heads: int, num_kv_heads: int) -> list[RunMetadata]:  # noqa: ANN001
    """Every run's metadata, uploaded once per step (no host wait: pinned, non-blocking)."""
    from roofline.kernels import prefill_attention_gqa as gqa

    out = []
    for run in plan.runs:
        i0, i1 = run.first, run.end
        starts = [s - run.start for s in meta.query_start_loc_cpu[i0 : i1 + 1]]
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        qsl = torch.tensor(starts, dtype=torch.int32)  # [n + 1]
        if meta.seq_lens.is_cuda:
            qsl = qsl.pin_memory().to(meta.seq_lens.device, non_blocking=True)
        max_len = max(query_lens)
        seq_lens_cpu = meta.seq_lens_cpu[i0:i1]
        packed = gqa.ENABLED and max_len > 1 and gqa.applies(num_heads, num_kv_heads, query_lens)
        out.append(RunMetadata(
            start=run.start, stop=run.stop, query_start_loc=qsl,
            seq_lens=meta.seq_lens[i0:i1].to(torch.int32, copy=True),
            block_table=meta.block_table[i0:i1].clone(), max_query_len=max_len,
            has_prefix=any(s != n for s, n in zip(seq_lens_cpu, query_lens, strict=True)),
            packed=packed, first=i0, end=i1,
        ))  # fmt: skip
    return out


def _run_prefix(rm: RunMetadata, prefix: GatheredPrefix | None) -> GatheredPrefix | None:
    """The run's slice of the step's gathered prefixes (made once per step)."""
    if prefix is None or not rm.has_prefix:
        return None
    if rm.prefix_memo is None or rm.prefix_memo[0] is not prefix.start_loc:
        rm.prefix_memo = (prefix.start_loc, prefix.start_loc[rm.first : rm.end].clone())
    return GatheredPrefix(prefix.k, prefix.v, rm.prefix_memo[1])


def attend_runs(
    runs: list[RunMetadata],
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

    for rm in runs:
        r0, r1 = rm.start, rm.stop
        if rm.packed:
            gqa.prefill_attention_gqa(
                q[r0:r1], k_cache, v_cache, rm.block_table, rm.query_start_loc, rm.seq_lens,
                scale, out=out[r0:r1],
            )  # fmt: skip
            continue
        step_rows = rm.max_query_len >= TMA_MIN_QUERY_LEN
        prefill_attention(
            q[r0:r1], k_cache, v_cache, rm.block_table, rm.query_start_loc, rm.seq_lens, scale,
            max_query_len=rm.max_query_len, out=out[r0:r1],
            k_new=k[r0:r1] if step_rows else None, v_new=v[r0:r1] if step_rows else None,
            prefix=_run_prefix(rm, prefix), has_prefix=rm.has_prefix,
        )  # fmt: skip
