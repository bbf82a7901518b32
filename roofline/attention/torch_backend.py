"""Reference attention over the paged KV cache in plain torch (CPU and GPU).

Stores the step's new K/V into their slots, then attends. Decode rows (query length 1) are
gathered from their pages into one padded batch and go through a single masked SDPA call;
prefill/extend rows run one request at a time with a causal mask shifted by the cached context.
This is the correctness reference the Triton backend is tested against, and the CPU fast path.
A quantized cache (fp8 / int8 pages, ``kv_scales`` given) is quantized on store and only the
pages a call reads are dequantized, per call (``quantization/kv_cache.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.attention.metadata import AttentionMetadata
from roofline.quantization.kv_cache import gather_dequantized, store_quantized_ref


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]
    # caches: [num_pages, page_size, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _pages(
    cache: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [len(ids), page_size, num_kv_heads, head_dim]
    # index_select, not cache[ids]: advanced indexing on a large CPU tensor costs milliseconds
    if scale is None:
        pages = cache.index_select(0, ids)
        # fp16 pages under an fp32 model (the CPU decoder's): widened as read
        return pages if dtype is None or pages.dtype == dtype else pages.to(dtype)
    return gather_dequantized(cache, scale, ids, dtype)


def gather_kv(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence: [seq_len, num_kv_heads, head_dim]
    (dequantized to ``dtype`` when ``scale`` is given)."""
    page_size = cache.shape[1]
    num_blocks = (seq_len + page_size - 1) // page_size
    pages = _pages(cache, scale, block_ids[:num_blocks], dtype)  # [blocks, page, heads, dim]
    return pages.flatten(0, 1)[:seq_len]


class TorchAttentionBackend:
    name = "torch"
    kv_cache_dtypes = ("auto", "fp8", "int8")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
        if kv_scales is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            store_quantized_ref(k, v, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping)
        if meta.is_decode_only and meta.cascade is not None:  # the fp32 reference (tests)
            from roofline.kernels.cascade_attention import cascade_attention_ref

            c = meta.cascade
            return cascade_attention_ref(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, c.prefix_pages,
                int(c.prefix_len[0]), c.suffix_start, scale, k_scale, v_scale,
            )  # fmt: skip
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            rows = slice(starts[i], starts[i] + q_len)
            ks = gather_kv(k_cache, meta.block_table[i], seq_len, k_scale, q.dtype)
            vs = gather_kv(v_cache, meta.block_table[i], seq_len, v_scale, q.dtype)
            out[rows] = _attend(q[rows], ks, vs, seq_len - q_len, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        page_size = k_cache.shape[1]
        num_blocks = (meta.max_seq_len + page_size - 1) // page_size
        ids = meta.block_table[:, :num_blocks].reshape(-1)
        shape = (meta.num_reqs, num_blocks * page_size, *k_cache.shape[2:])
        # [num_reqs, num_blocks * page_size, num_kv_heads, head_dim] -> heads first, then only the
        # first max_seq_len keys: a lone request then attends over exactly its own keys, as HF's
        # SDPA call does (padding keys, even masked, change how SDPA blocks the sum).
        ks = _pages(k_cache, k_scale, ids, q.dtype).view(shape).transpose(1, 2)
        vs = _pages(v_cache, v_scale, ids, q.dtype).view(shape).transpose(1, 2)
        ks, vs = ks[:, :, : meta.max_seq_len], vs[:, :, : meta.max_seq_len]
        positions = torch.arange(ks.shape[2], device=q.device)
        mask = positions[None, :] < meta.seq_lens[:, None]  # [num_reqs, max_len]
        qh = q.unsqueeze(2)  # [num_reqs, num_heads, 1, head_dim]
        out = F.scaled_dot_product_attention(
            qh,
            ks,
            vs,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != ks.shape[1],
        )
        return out.squeeze(2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Causal attention of ``q`` (the last q_len positions) over all ``k``/``v`` positions.

    SDPA gets 4-D ``[1, heads, len, head_dim]`` tensors, as from HF: with 3-D ones torch picks
    another kernel on the CPU, whose half-precision results differ in the last bit."""
    q_len, seq_len = q.shape[0], k.shape[0]
    # heads first: [1, heads, len, head_dim]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if context_len == 0:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + context_len
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # [q_len, seq_len]
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)
