"""The descriptor (TMA) variant of prefill attention against the torch reference: the step's own
keys read from ``k_new``/``v_new`` (strided views of one QKV tensor, as the model passes them),
the cached prefix from the pages; fresh prompts, chunks over a prefix, decode rows, an empty
request; masked and unmasked blocks; and the fall-back to the paged kernel where it cannot run."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged

from roofline.kernels import prefill_attention_tma as tma
from roofline.kernels.prefill_attention import prefill_attention, prefill_attention_ref

HEAD_DIM = 128 if ON_GPU else 32
QUERY_LENS = [300, 1, 129, 0, 1000, 17] if ON_GPU else [70, 1, 40, 0, 17]
CONTEXT_LENS = [0, 800, 77, 5, 1500, 3] if ON_GPU else [0, 30, 13, 4, 9]


def _qkv_views(batch, num_heads: int, num_kv_heads: int):
    """q, k_new, v_new as views of one [T, (H + 2 Hk) * D] tensor (the QKV GEMM's output)."""
    lens = list(zip(batch.seq_lens_list, batch.query_lens, strict=True))
    k = torch.cat([ks[s - q :] for ks, (s, q) in zip(batch.k_seqs, lens, strict=True)])
    v = torch.cat([vs[s - q :] for vs, (s, q) in zip(batch.v_seqs, lens, strict=True)])
    t, d = k.shape[0], HEAD_DIM
    qkv = torch.cat([batch.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    q_size, kv_size = num_heads * d, num_kv_heads * d
    q_v, k_v, v_v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q_v.view(t, num_heads, d), k_v.view(t, num_kv_heads, d), v_v.view(t, num_kv_heads, d))


@pytest.mark.parametrize(
    "dtype,group,variant",
    [(torch.float32, 4, "tma"), (torch.bfloat16, 1, "tma_ws"), (torch.bfloat16, 4, "tma_hf")],
    ids=["fp32-gqa4-tma", "bf16-mha-tma_ws", "bf16-gqa4-tma_hf"],
)
def test_tma_matches_reference(dtype: torch.dtype, group: int, variant: str) -> None:
    num_kv_heads = 2
    batch = make_paged(QUERY_LENS, CONTEXT_LENS, num_kv_heads * group, num_kv_heads, HEAD_DIM,
                       16, dtype, seed=group)  # fmt: skip
    q, k_new, v_new = _qkv_views(batch, num_kv_heads * group, num_kv_heads)
    assert tma.tma_applies(q, k_new, v_new)
    args = (q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, HEAD_DIM**-0.5)  # fmt: skip
    ref = prefill_attention_ref(*args)
    blocks = {} if ON_GPU else dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out = prefill_attention(*args, max(QUERY_LENS), k_new=k_new, v_new=v_new, variant=variant,
                            **blocks)  # fmt: skip
    n = sum(QUERY_LENS)
    assert_close(out[:n], ref[:n], dtype)


def test_falls_back_to_paged() -> None:
    batch = make_paged([20, 3], [5, 0], 4, 2, HEAD_DIM, 16, torch.bfloat16, seed=7)
    q, k_new, v_new = _qkv_views(batch, 4, 2)
    assert not tma.tma_applies(q, None, None)
    assert not tma.tma_applies(q, k_new[:-1], v_new[:-1])
    odd = torch.zeros(q.shape[0], 4, 24, dtype=q.dtype, device=DEVICE)
    assert not tma.tma_applies(odd, odd[:, :2], odd[:, 2:])
    args = (q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, 0.2)  # fmt: skip
    # No k_new: the paged kernel runs whatever the variant.
    out = prefill_attention(*args, 20, variant="tma")
    assert_close(out, prefill_attention_ref(*args), torch.bfloat16)
    # The paged kernel in heads-fastest launch order.
    out = prefill_attention(*args, 20, variant="base_hf")
    assert_close(out, prefill_attention_ref(*args), torch.bfloat16)
    with pytest.raises(ValueError, match="variant"):
        prefill_attention(*args, 20, variant="nope")
