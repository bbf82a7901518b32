"""Helpers for the kernel parity tests: device choice, tolerances, paged batches, dense SDPA.

``make_paged`` builds a ragged batch over a shuffled paged KV cache (pages no request owns are
filled with large garbage, so a kernel reading the wrong page fails loudly) together with the
dense (unpaged) K/V each request should see, so tests can compare kernels, their torch references
and plain ``scaled_dot_product_attention``. Importing this module imports no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# (atol, rtol) for outputs of O(1) magnitude, by input dtype.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: slots of the query (new) tokens
    k_seqs: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    v_seqs: list[torch.Tensor]
    query_lens: list[int]
    seq_lens_list: list[int]


def make_paged(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_pages: int = 3,
) -> PagedBatch:
    """Request ``i`` has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones, all
    of whose K/V are already in the (randomly permuted) pages; ``q`` holds the new tokens' rows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(blocks) + spare_pages
    max_blocks = max(max(blocks), 1)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    # Garbage everywhere first (pages and rows no request owns must never be read).
    k_cache = torch.randn(shape, generator=gen) * 100
    v_cache = torch.randn(shape, generator=gen) * 100
    perm = torch.randperm(num_pages, generator=gen).tolist()
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_seqs, v_seqs, slots = [], [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pages = [perm.pop() for _ in range(blocks[i])]
        block_table[i, : blocks[i]] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(seq_len)
        slot = torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size
        slot = slot + pos % page_size  # [seq_len]
        k_cache.view(-1, num_kv_heads, head_dim)[slot] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slot] = v
        k_seqs.append(k.to(dtype).to(DEVICE))
        v_seqs.append(v.to(dtype).to(DEVICE))
        slots.append(slot[seq_len - q_len :])
    num_tokens = sum(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        v_cache=v_cache.to(dtype).to(DEVICE),
        block_table=block_table.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        k_seqs=k_seqs,
        v_seqs=v_seqs,
        query_lens=list(query_lens),
        seq_lens_list=seq_lens,
    )


def dense_causal_sdpa(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Naive reference: SDPA on each request's unpaged K/V with an explicit shifted causal mask."""
    num_heads = batch.q.shape[1]
    out = torch.empty_like(batch.q, dtype=torch.float32)
    start = 0
    for q_len, seq_len, k, v in zip(
        batch.query_lens, batch.seq_lens_list, batch.k_seqs, batch.v_seqs, strict=True
    ):
        if q_len == 0:
            continue
        group = num_heads // k.shape[1]
        qh = batch.q[start : start + q_len].float().transpose(0, 1)  # [H, L, D]
        kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=qh.device)
        mask = torch.arange(seq_len, device=qh.device)[None, :] <= q_pos[:, None]  # [L, S]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale
        )
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out
