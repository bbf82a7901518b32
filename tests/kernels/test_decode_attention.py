"""Paged decode attention: the torch reference against dense SDPA, the kernel against the reference.

Covers fp32/fp16/bf16, GQA ratios 1/3/4/8, page sizes 8..128, context lengths that are not page
multiples (1 included), forced and automatic split counts, and a non-power-of-two head_dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_utils import ON_GPU, assert_close, dense_causal_sdpa, make_paged

from roofline.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)

HEAD_DIM = 128 if ON_GPU else 32
SEQ_LENS = [1, 700, 2049, 333, 16, 4100, 95, 1024] if ON_GPU else [1, 37, 70, 16, 19]
NUM_KV_HEADS = 2 if ON_GPU else 1


def _batch(dtype: torch.dtype, group: int, page_size: int, head_dim: int = HEAD_DIM, seed: int = 0,
           num_kv_heads: int = NUM_KV_HEADS):  # fmt: skip
    context = [s - 1 for s in SEQ_LENS]
    return make_paged(
        [1] * len(SEQ_LENS), context, num_kv_heads * group, num_kv_heads, head_dim, page_size,
        dtype, seed=seed,
    )  # fmt: skip


def _run(batch, scale: float, **kwargs) -> torch.Tensor:
    return decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
        max_seq_len=max(batch.seq_lens_list), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_sdpa(group: int) -> None:
    batch = _batch(torch.float32, group, 16)
    scale = HEAD_DIM**-0.5
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
    )
    torch.testing.assert_close(ref, dense_causal_sdpa(batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_kernel_matches_reference(dtype: torch.dtype, group: int) -> None:
    batch = _batch(dtype, group, 16, seed=group)
    scale = HEAD_DIM**-0.5
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
    )
    assert_close(_run(batch, scale), ref, dtype)


@pytest.mark.parametrize("page_size", [8, 32, 64, 128])
def test_page_sizes(page_size: int) -> None:
    batch = _batch(torch.bfloat16, 4, page_size, seed=page_size)
    scale = 0.1
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
    )
    assert_close(_run(batch, scale), ref, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64 if ON_GPU else 16])
def test_forced_splits(num_splits: int) -> None:
    """Any split count gives the same answer, including splits left empty by short requests."""
    batch = _batch(torch.float16, 4, 16, seed=7)
    scale = HEAD_DIM**-0.5
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
    )
    assert_close(_run(batch, scale, num_splits=num_splits), ref, torch.float16)


def test_odd_head_dim() -> None:
    head_dim = 80 if ON_GPU else 24
    batch = _batch(torch.float16, 2, 16, head_dim=head_dim, seed=3, num_kv_heads=3)
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, 0.2
    )
    assert_close(_run(batch, 0.2, num_splits=3), ref, torch.float16)


def test_writes_into_given_out_and_strided_q() -> None:
    batch = _batch(torch.float16, 4, 16, seed=11)
    # q as a strided view, the way it comes out of a fused QKV projection.
    wide = torch.randn(batch.q.shape[0], batch.q.shape[1] + 3, HEAD_DIM, device=batch.q.device)
    wide = wide.to(torch.float16)
    q = wide[:, 1 : 1 + batch.q.shape[1]]
    out = torch.empty_like(batch.q)
    res = decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, 0.1, out=out
    )
    assert res is out
    ref = decode_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, 0.1
    )
    assert_close(out, ref, torch.float16)


def test_choose_num_splits_fills_the_gpu() -> None:
    # Large batch: the grid already covers 132 SMs twice, no split.
    assert choose_num_splits(64, 8, 4096, 132, 64) == 1
    # One long request: split, but no split shorter than 128 tokens.
    assert choose_num_splits(1, 8, 4096, 132, 64) == 32
    assert choose_num_splits(1, 8, 300, 132, 64) == 3
    assert choose_num_splits(1, 1, 10**6, 132, 64) == 64
    assert choose_num_splits(4, 8, 1, 132, 64) == 1


@pytest.mark.parametrize("with_start", [False, True])
def test_device_split_length_follows_each_context(monkeypatch, with_start: bool) -> None:
    """``DEVICE_SPLIT``: a grid sized for a 131,072-token ``max_seq_len`` (as a CUDA graph
    captures it) still cuts each request's own context into ``cdiv(context, 128)`` splits (at
    most the grid's): the partials show which slots hold keys; the merged output is exact."""
    from roofline.kernels import decode_attention as da

    monkeypatch.setattr(da, "DEVICE_SPLIT", True)
    lens = [1, 129, 300, 513, 64]
    batch = make_paged([1] * len(lens), [n - 1 for n in lens], 4, 1, 32, 16, torch.float32, seed=5)
    scale = 32**-0.5
    num_splits = 4
    starts = torch.tensor([0, 0, 100, 1, 0], dtype=torch.int32) if with_start else None
    part_out = torch.zeros(len(lens), 4, num_splits, 32)
    part_lse = torch.zeros(len(lens), 4, num_splits)
    kwargs = {"ctx_start": starts, "partials": (part_out, part_lse)}
    decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
        max_seq_len=131072, num_splits=num_splits, **kwargs,
    )  # fmt: skip
    offsets = [0] * len(lens) if starts is None else starts.tolist()
    contexts = [n - s for n, s in zip(lens, offsets)]
    for r, ctx in enumerate(contexts):
        used = min(max(math.ceil(ctx / 128), 1), num_splits)
        split_len = math.ceil(math.ceil(ctx / used) / 64) * 64
        filled = [j for j in range(num_splits) if j * split_len < ctx]
        finite = torch.isfinite(part_lse[r, 0]).nonzero().flatten().tolist()
        assert finite == filled, (r, ctx, finite, filled)
    out = torch.empty_like(batch.q)
    da.merge_partials(part_out, part_lse, out)
    if starts is None:
        ref = decode_attention_ref(
            batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
        )
        assert_close(out, ref, torch.float32)
        merged = decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
            max_seq_len=131072, num_splits=num_splits,
        )  # fmt: skip
        assert_close(merged, ref, torch.float32)
    else:  # each row over its own window: the reference on a shifted block table
        for r, (n, s) in enumerate(zip(lens, starts.tolist())):
            k = batch.k_cache[batch.block_table[r].long()].reshape(-1, 1, 32)[s:n]  # [ctx, 1, D]
            v = batch.v_cache[batch.block_table[r].long()].reshape(-1, 1, 32)[s:n]
            probs = torch.softmax(torch.einsum("hd,sd->hs", batch.q[r], k[:, 0]) * scale, -1)
            torch.testing.assert_close(out[r], probs @ v[:, 0], atol=1e-5, rtol=1e-5)


def test_device_split_compiles_for_hopper() -> None:
    """The GPU's launch of the split kernel with ``DEVICE_SPLIT`` (and PDL, which the
    interpreter leaves off) compiles for sm_90 through ptxas, with and without a cascade start."""
    from hopper_variants import compile_for_hopper

    from roofline.kernels import decode_attention as da

    kernel = da._decode_split_kernel
    pointers = {name: "bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    pointers.update(k_scale_ptr="fp32", v_scale_ptr="fp32", block_table_ptr="i32",
                    seq_lens_ptr="i32", ctx_start_ptr="i32", part_out_ptr="fp32",
                    part_lse_ptr="fp32")  # fmt: skip
    base = dict(
        NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64,
        SINGLE_SPLIT=False, PRECISION="tf32", KV_QUANT=False, HAS_START=False,
        MERGE_PREFIX=False, PDL=True, DEVICE_SPLIT=True, MIN_SPLIT=128,
    )  # fmt: skip
    variants = [base, dict(base, HAS_START=True, PDL=False)]
    ptxs = compile_for_hopper(
        "roofline.kernels.decode_attention", "_decode_split_kernel", variants, pointers,
        ("scale_log2e",), dict(num_warps=4, num_stages=3),
    )  # fmt: skip
    assert len(ptxs) == 2 and "griddepcontrol.wait" in ptxs[0]


@pytest.mark.parametrize("device_split", [False, True])
def test_split_lengths_from_the_host_or_the_device_agree(monkeypatch, device_split: bool) -> None:
    """``ROOFLINE_DECODE_DEVICE_SPLIT=0`` keeps the host's split length (``max_seq_len /
    num_splits``): both ways give the reference for a grid sized for 131,072 tokens."""
    from roofline.kernels import decode_attention as da

    monkeypatch.setattr(da, "DEVICE_SPLIT", device_split)
    lens = [1, 300, 513]
    batch = make_paged([1] * len(lens), [n - 1 for n in lens], 4, 1, 32, 16, torch.float32, seed=7)
    scale = 32**-0.5
    ref = decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale
    )
    out = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
        max_seq_len=131072, num_splits=4,
    )  # fmt: skip
    assert_close(out, ref, torch.float32)
