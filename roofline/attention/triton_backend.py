"""Triton attention backend: paged KV store, then flash-decoding or varlen causal flash attention.

Same contract as ``torch_backend.TorchAttentionBackend``: ``forward`` first writes the step's new
K/V rows into the layer's cache at ``meta.slot_mapping`` (given ``rope``, one fused kernel rotates
q and k and stores: ``kernels.kv_store.rotary_kv_store``), then attends every query row over its
request's cached sequence. A decode-only step (every request brings exactly one query token) goes
to ``kernels.decode_attention`` (split-K over the context, GQA-grouped loads); any other step
(prefill, chunked prefill, prefix-cache hits, mixed with decode rows) goes to
``kernels.prefill_attention``, which handles query length 1 rows as well; an eager step's long
fresh prompt chunks go to cuDNN instead (``attention/sdpa_prefill.py``; ``ROOFLINE_SDPA_PREFILL=0``
turns that off). Host-side values come
from the metadata's CPU fields, so the forward never syncs with the device. A quantized cache
(``kv_scales`` given) is quantized by the store and read in registers by the attention kernels;
a fresh prefill step's own rows are read back dequantized for the descriptor kernel instead
(``fresh_rows_dequantized``).
"""

from __future__ import annotations

import torch

from roofline.attention.metadata import AttentionMetadata
from roofline.attention.sdpa_prefill import SdpaPrefill
from roofline.kernels import decode_attention_fused
from roofline.kernels import prefill_attention as pa
from roofline.kernels import prefill_attention_gqa as gqa
from roofline.kernels.cascade_attention import cascade_attention
from roofline.kernels.decode_attention import decode_attention
from roofline.kernels.kv_store import rotary_kv_store, store_kv
from roofline.kernels.prefill_attention import has_cached_context, prefill_attention
from roofline.kernels.prefill_attention_tma import tma_applies
from roofline.kernels.prefix_gather import PrefixGatherer
from roofline.kernels.verify_attention import verify_attention
from roofline.quantization.kv_cache import dequantize


def store_step_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
    rope: tuple | None,  # (positions, cos_sin_cache, qk_norm or None)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,  # quantized cache's scales
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Store the step's K/V into the paged cache (with RoPE and the optional q/k norm applied
    to q and k in place, in one kernel, when ``rope`` is given); the cache's (k, v) scales."""
    k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
    if rope is None:
        store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:  # q and k rotated in place, k and v stored: one kernel
        positions, cos_sin, qk_norm = rope
        rotary_kv_store(
            q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm,
            k_scale, v_scale,
        )  # fmt: skip
    return k_scale, v_scale


DEQUANT_FRESH = True
"""Fresh prefill steps over 1-byte pages take the descriptor kernel on their rows dequantized
from the cache (``fresh_rows_dequantized``); False: the paged kernel reads the pages."""


def fresh_rows_dequantized(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim] 1-byte
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_pages, page_size, num_kv_heads] fp32
    v_scale: torch.Tensor,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A prefill step without cached context over a quantized cache: its K and V rows read back
    from the pages just stored and dequantized (``kv_cache.dequantize``: the values every later
    read of these pages sees, so a prompt computed fresh and one served from the prefix cache
    attend the same keys), ``[num_tokens, num_kv_heads, head_dim]`` in q's dtype, for the
    descriptor kernel (the paged kernel widens 1-byte tiles itself, at about two thirds of the
    rate: H100, an 8,192-token fp8 prompt's attention 2.1 ms a layer against 1.4 over bf16
    pages). None where that kernel would not take them (``DEQUANT_FRESH`` off, a default
    variant without descriptors, unaligned q)."""
    if not DEQUANT_FRESH or not pa.DEFAULT_VARIANT.startswith("tma"):
        return None
    slots = meta.slot_mapping[: q.shape[0]].clamp_min(0).long()  # (padding rows: any row)
    rows = [
        dequantize(cache.flatten(0, 1).index_select(0, slots),
                   s.flatten(0, 1).index_select(0, slots), q.dtype)
        for cache, s in ((k_cache, k_scale), (v_cache, v_scale))
    ]  # fmt: skip
    return (rows[0], rows[1]) if tma_applies(q, rows[0], rows[1]) else None


TMA_MIN_QUERY_LEN = 64
"""Longest query of a step from which this backend hands the descriptor kernel the step's rows
(the split backend, whose prefill part holds no decode rows, always does)."""


class TritonAttentionBackend:
    name = "triton"
    fuses_rope = True
    kv_cache_dtypes = ("auto", "fp8", "int8")
    supports_cascade = True
    """Shared-prefix decode (``meta.cascade``) runs its kernels (1-byte pages too)."""

    def __init__(self, decode_num_splits: int | None = None) -> None:
        # Fixed split count for decode (e.g. for CUDA-graph capture); None = chosen per step.
        self.decode_num_splits = decode_num_splits
        self.prefix_gather = PrefixGatherer()  # long chunks' cached prefixes, gathered per layer
        self.gqa_prefill = gqa.StepChoice()  # eager steps of mostly short chunks: packed tiles
        self.sdpa_prefill = SdpaPrefill()  # long fresh prompt chunks through cuDNN (eager steps)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: tuple | None = None,  # (positions, cos_sin_cache, qk_norm or None)
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantized cache's scales
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if (  # one launch: q/k norm, RoPE, K/V store, attention, split merge
            rope is not None
            and meta.is_decode_only
            and meta.cascade is None
            and decode_attention_fused.applies(q, k_cache, rope[1], kv_scales is not None)
        ):
            positions, cos_sin, qk_norm = rope
            return decode_attention_fused.fused_decode_attention(
                q, k, v, positions, cos_sin, qk_norm, k_cache, v_cache, meta.slot_mapping,
                meta.block_table, meta.seq_lens, scale, meta.max_seq_len,
                max_splits=self.decode_num_splits,
            )  # fmt: skip
        k_scale, v_scale = store_step_kv(q, k, v, k_cache, v_cache, meta.slot_mapping, rope,
                                         kv_scales)  # fmt: skip
        if meta.uniform_query_len > 1:  # speculative verification: 1 + k rows per request
            return verify_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale,
                meta.uniform_query_len, meta.max_seq_len, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        if meta.is_decode_only and meta.cascade is not None:
            c = meta.cascade
            return cascade_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, c.prefix_pages,
                c.prefix_len, c.suffix_start, scale, max_suffix_len=c.max_suffix_len,
                max_prefix_len=c.max_prefix_len, num_splits=c.num_splits,
                prefix_splits=c.prefix_splits, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        if meta.is_decode_only:
            return decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                num_splits=self.decode_num_splits,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        sdpa = self.sdpa_prefill  # long prompt chunks through cuDNN, the rest as below
        plan = sdpa.plan(q, meta, kv_scales is not None) if sdpa.enabled else None
        if plan is not None:
            try:
                gather = lambda: self.prefix_gather.gather(q, k, v, k_cache, v_cache, meta)  # noqa: E731
                return sdpa.forward(plan, q, k, v, k_cache, v_cache, meta, scale, gather=gather)
            except RuntimeError as e:  # e.g. no cuDNN attention in this torch build
                sdpa.disable(e)
        if self.gqa_prefill(q, k_cache, meta):  # mostly short chunks: GQA-packed tiles
            return gqa.prefill_attention_gqa(
                q, k_cache, v_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
                scale, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        # this step's keys (rotated in place) and values, for the "tma" variants, once a chunk
        # is long enough (decode rows in this path get a query tile each: a descriptor box of
        # the step's keys per row would be read for one useful row)
        long = meta.max_query_len >= TMA_MIN_QUERY_LEN
        k_new, v_new = (k, v) if long else (None, None)
        prefix = self.prefix_gather.gather(q, k, v, k_cache, v_cache, meta, k_scale)
        has_prefix = has_cached_context(meta)
        if k_scale is not None and long and not has_prefix:
            fresh = fresh_rows_dequantized(q, k_cache, v_cache, k_scale, v_scale, meta)
            if fresh is not None:  # nothing reads the pages: the rows as they were stored
                (k_new, v_new), k_scale, v_scale = fresh, None, None
        return prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
            k_scale=k_scale,
            v_scale=v_scale,
            k_new=k_new,
            v_new=v_new,
            prefix=prefix,
            has_prefix=has_prefix,
        )
