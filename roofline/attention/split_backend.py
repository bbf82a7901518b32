"""Mixed-step attention split by row kind: decode rows to the decode kernel, the rest to prefill.

A mixed step (prefill chunks beside decode rows) sent whole to ``kernels.prefill_attention``
gives every decode row its own query tile of ``BLOCK_M`` rows (128 beside a long chunk): 1 useful
row in 128 on the tensor cores, and one K/V read per query head instead of one per KV-head group.
Here the batch is laid out decode-first (requests ``0 .. D - 1`` bring one query row each, rows
``0 .. D - 1``), and attention runs as two launches over the step's paged cache after the usual
store (RoPE fused):

* ``decode_attention`` over ``q[:decode_slots]`` with the decode part's own context lengths and
  block table (slots past the real decodes have length 0: the kernel writes zeros there);
* ``prefill_attention`` over all of ``q`` with the metadata's base fields, which describe only
  the requests after the decodes (their query ranges are absolute rows, starting at ``D``); it
  runs second, so it overwrites whatever the decode launch wrote on prefill rows. It gets the
  step's own K/V rows (the descriptor kernel reads the chunks' keys from them) and, in eager
  steps, the long chunks' gathered prefixes (``kernels/prefix_gather.py``).

Every per-request value is read on the device and the grids depend only on the slot counts, the
token count and the tile size: the same metadata serves an eager step (exact sizes, views of the
step's tensors) and a CUDA graph over a token-count bucket (``worker/mixed_graph.py``: padded
slots, padding rows owned by one padding request whose K/V go to slot -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roofline.attention.cascade import CascadeMetadata
from roofline.attention.metadata import AttentionMetadata
from roofline.attention.triton_backend import fresh_rows_dequantized, store_step_kv
from roofline.kernels import prefill_attention_gqa as gqa
from roofline.kernels.cascade_attention import cascade_attention
from roofline.kernels.decode_attention import decode_attention
from roofline.kernels.prefill_attention import has_cached_context, prefill_attention
from roofline.kernels.prefix_gather import GatheredPrefix


@dataclass(kw_only=True)  # keyword fields: the base may gain defaulted ones
class SplitMetadata(AttentionMetadata):
    """Attention metadata of a decode-first mixed step. The base fields describe the prefill
    part only: ``num_reqs`` requests after the decodes, ``query_start_loc`` their absolute
    query rows (``[num_reqs + 1]``, from the first prefill row), ``seq_lens``, ``block_table``
    and ``max_query_len`` theirs; ``slot_mapping`` and ``num_tokens`` cover every row."""

    decode_slots: int
    """Rows given to the decode kernel (its grid): the decode count in an eager step, the
    bucket's capacity in a graph."""
    decode_seq_lens: torch.Tensor
    """[decode_slots] int32 on device: context length of each decode request, 0 past them."""
    decode_block_table: torch.Tensor
    """[decode_slots, max_num_blocks] int32 on device: the decode requests' page ids."""
    decode_max_seq_len: int
    """Host bound on ``decode_seq_lens`` (sizes the decode split)."""
    decode_num_splits: int | None
    """Fixed split count of the decode launch (graphs), or None: chosen per step."""
    prefill_config: tuple[int, int, int, int] | None = None
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill launch (graphs: fixed for the
    bucket), or None: chosen from ``max_query_len``."""
    decode_cascade: CascadeMetadata | None = None
    """The decode rows' shared prefix (an eager step's ``attention/cascade.py`` plan over its
    decode rows): they attend it once for the group, then each its own suffix."""


class SplitAttentionBackend:
    """Wraps a ``TritonAttentionBackend``: steps with ``SplitMetadata`` take the two launches
    above, any other step goes to the wrapped backend unchanged."""

    name = "triton-split"
    fuses_rope = True

    def __init__(self, base) -> None:
        self.base = base
        self.kv_cache_dtypes = base.kv_cache_dtypes

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: tuple | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not isinstance(meta, SplitMetadata):
            extra: dict = {} if rope is None else {"rope": rope}
            if kv_scales is not None:
                extra["kv_scales"] = kv_scales
            return self.base.forward(q, k, v, k_cache, v_cache, meta, scale, **extra)
        k_scale, v_scale = store_step_kv(q, k, v, k_cache, v_cache, meta.slot_mapping, rope,
                                         kv_scales)  # fmt: skip
        sdpa = self.base.sdpa_prefill  # an eager step's long prompt chunks through cuDNN
        plan = None
        if sdpa.enabled and meta.prefill_config is None:
            plan = sdpa.plan(q, meta, kv_scales is not None)
        if plan is not None:
            try:
                return self._sdpa_step(plan, q, k, v, k_cache, v_cache, meta, scale)
            except RuntimeError as e:  # e.g. no cuDNN attention in this torch build
                sdpa.disable(e)
        if meta.prefill_config is None:  # an eager step: its own choice
            packed = self.base.gqa_prefill(q, k_cache, meta)
        else:  # a graph bucket
            packed = gqa.in_graph_bucket(q.shape[1], k_cache.shape[2])
        prefix = None
        if not packed:  # (the packed kernel reads the pages itself)
            prefix = self.base.prefix_gather.gather(q, k, v, k_cache, v_cache, meta, k_scale)
        return split_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, k, v, prefix,
                               packed)  # fmt: skip

    def _sdpa_step(self, plan, q, k, v, k_cache, v_cache, meta, scale):  # noqa: ANN001, ANN202
        """Decode rows as ``split_attention`` runs them, the prefill part by ``SdpaPrefill``
        (``attention/sdpa_prefill.py``); a 16/32-bit cache (the plan's condition)."""
        out = None
        if meta.decode_slots:
            out = split_attention(q, k_cache, v_cache, meta, scale, attend_prefill=False)
        gather = lambda: self.base.prefix_gather.gather(q, k, v, k_cache, v_cache, meta)  # noqa: E731
        return self.base.sdpa_prefill.forward(plan, q, k, v, k_cache, v_cache, meta, scale,
                                              out=out, gather=gather)  # fmt: skip


def split_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], K/V already stored
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: SplitMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the rows stored
    v_new: torch.Tensor | None = None,  # (for the descriptor kernel, prefill_attention_tma.py)
    prefix: GatheredPrefix | None = None,  # long chunks' prefixes, gathered (prefix_gather.py)
    packed: bool = False,  # the prefill part through prefill_attention_gqa (mostly short chunks)
    attend_prefill: bool = True,  # False: decode rows only (the caller attends the rest)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    d = meta.decode_slots
    c = meta.decode_cascade
    if d and c is not None:
        cascade_attention(
            q[:d], k_cache, v_cache, meta.decode_block_table, meta.decode_seq_lens,
            c.prefix_pages, c.prefix_len, c.suffix_start, scale,
            max_suffix_len=c.max_suffix_len, max_prefix_len=c.max_prefix_len, out=out[:d],
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    elif d:
        decode_attention(
            q[:d],
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            scale,
            max_seq_len=meta.decode_max_seq_len,
            num_splits=meta.decode_num_splits,
            out=out[:d],
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if not attend_prefill:
        return out
    if meta.num_reqs and packed:  # mostly short chunks: GQA-packed tiles
        gqa.prefill_attention_gqa(
            q, k_cache, v_cache, meta.block_table, meta.query_start_loc, meta.seq_lens, scale,
            out=out, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    elif meta.num_reqs:
        tiles = {}
        if meta.prefill_config is not None:  # a graph bucket: the paged kernel's tiles measured
            names = ("block_m", "block_n", "num_warps", "num_stages")  # for it (22.6 vs 29.9 us
            tiles = dict(zip(names, meta.prefill_config, strict=True))  # at 768 rows); the
            tiles["variant"] = "base"  # descriptor kernel was not measured inside buckets
        has_prefix = has_cached_context(meta)
        if k_scale is not None and k_new is not None and not has_prefix and not tiles:
            fresh = fresh_rows_dequantized(q, k_cache, v_cache, k_scale, v_scale, meta)
            if fresh is not None:  # fresh chunks over 1-byte pages: their rows as stored
                (k_new, v_new), k_scale, v_scale = fresh, None, None
        prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
            k_new=k_new,
            v_new=v_new,
            prefix=prefix,
            has_prefix=has_prefix,
            **tiles,
        )
    return out
