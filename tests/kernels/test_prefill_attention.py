"""Varlen causal attention over the paged cache: reference vs dense SDPA, kernel vs reference.

Batches mix fresh prompts (context 0), chunked-prefill / prefix-hit rows (cached context not a
multiple of the page size), decode rows (query length 1) and an empty request, over fp32/fp16/
bf16, GQA ratios 1/3/4/8 and page sizes 8..128.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import ON_GPU, assert_close, dense_causal_sdpa, make_paged

from roofline.kernels.decode_attention import decode_attention
from roofline.kernels.prefill_attention import (
    causal_attention_flops,
    prefill_attention,
    prefill_attention_ref,
)

HEAD_DIM = 128 if ON_GPU else 32
NUM_KV_HEADS = 2 if ON_GPU else 1
if ON_GPU:
    QUERY_LENS = [300, 1, 129, 0, 1000, 17, 1]
    CONTEXT_LENS = [0, 800, 77, 5, 1500, 3, 64]
else:
    QUERY_LENS = [5, 1, 40, 0, 17]
    CONTEXT_LENS = [0, 30, 13, 4, 9]


def _batch(dtype: torch.dtype, group: int, page_size: int, head_dim: int = HEAD_DIM, seed: int = 0,
           num_kv_heads: int = NUM_KV_HEADS):  # fmt: skip
    return make_paged(
        QUERY_LENS, CONTEXT_LENS, num_kv_heads * group, num_kv_heads, head_dim, page_size, dtype,
        seed=seed,
    )  # fmt: skip


def _ref(batch, scale: float) -> torch.Tensor:
    return prefill_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, scale,
    )  # fmt: skip


def _run(batch, scale: float, **kwargs) -> torch.Tensor:
    return prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, scale, max_query_len=max(batch.query_lens), **kwargs,
    )  # fmt: skip


def _valid_rows(x: torch.Tensor) -> torch.Tensor:
    return x[: sum(QUERY_LENS)]


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_sdpa(group: int) -> None:
    batch = _batch(torch.float32, group, 16)
    scale = HEAD_DIM**-0.5
    torch.testing.assert_close(
        _ref(batch, scale), dense_causal_sdpa(batch, scale), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_kernel_matches_reference(dtype: torch.dtype, group: int) -> None:
    batch = _batch(dtype, group, 16, seed=group)
    scale = HEAD_DIM**-0.5
    assert_close(_run(batch, scale), _ref(batch, scale), dtype)


@pytest.mark.parametrize("page_size", [8, 32, 64, 128])
def test_page_sizes(page_size: int) -> None:
    batch = _batch(torch.bfloat16, 4, page_size, seed=page_size)
    assert_close(_run(batch, 0.1), _ref(batch, 0.1), torch.bfloat16)


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_tile_shapes(block_m: int, block_n: int) -> None:
    """Other tilings (tile edges inside pages, pages inside tiles) give the same answer."""
    batch = _batch(torch.float16, 3, 16, seed=5)
    out = _run(batch, 0.2, block_m=block_m, block_n=block_n)
    assert_close(out, _ref(batch, 0.2), torch.float16)


def test_odd_head_dim() -> None:
    head_dim = 80 if ON_GPU else 24
    batch = _batch(torch.float16, 2, 16, head_dim=head_dim, seed=9, num_kv_heads=3)
    assert_close(_run(batch, 0.2), _ref(batch, 0.2), torch.float16)


def test_single_long_prompt() -> None:
    seq_len = 3000 if ON_GPU else 70
    batch = make_paged([seq_len], [0], 8, 2, HEAD_DIM, 16, torch.bfloat16, seed=1)
    scale = HEAD_DIM**-0.5
    assert_close(_run(batch, scale), dense_causal_sdpa(batch, scale), torch.bfloat16)


def test_decode_rows_match_decode_kernel() -> None:
    """A batch of query-length-1 rows through the prefill kernel equals the decode kernel."""
    seq_lens = [1, 45, 16, 33]
    batch = make_paged([1] * 4, [s - 1 for s in seq_lens], 8, 2, HEAD_DIM, 16, torch.float32)
    decode = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, 0.3,
        max_seq_len=max(seq_lens),
    )  # fmt: skip
    torch.testing.assert_close(_run(batch, 0.3), decode, atol=2e-5, rtol=1e-5)


def test_causal_flops() -> None:
    # One fresh 4-token prompt: 10 visible pairs; a decode row over 8 cached tokens: 9 pairs.
    assert causal_attention_flops([4, 9], [4, 1], num_heads=2, head_dim=8) == 4 * 8 * 2 * 19
