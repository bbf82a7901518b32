"""The LM head + greedy argmax kernel: logits bit-equal to the skinny GEMM's widened output and
ids equal to ``torch.argmax`` on them (ties to the lowest index, across programs and inside one),
on rows counts 1 to 8; and compiled for Hopper on the CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import last_program
from roofline.kernels.gemv import skinny_gemm
from roofline.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_ref


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_skinny_gemm_and_argmax(m: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m)
    vocab, hidden = 1000, 96  # vocab not a multiple of the column block; K not of BLOCK_K
    x = torch.randn(m, hidden, generator=gen).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(vocab, hidden, generator=gen)).to(dtype).to(DEVICE)
    # ties: row 0's best column planted twice, far apart (different programs) and adjacent
    best = int((x[0].float() @ w.float().T).argmax())
    for col in (min(best + 1, vocab - 1), vocab - 1):
        w[col] = w[best]
    logits, ids = lm_head_argmax(x, w)
    expected = skinny_gemm(x, w).float()
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    assert ids.tolist() == expected.argmax(dim=-1).tolist()
    ref_logits, ref_ids = lm_head_argmax_ref(x, w)
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=2e-2)
    counters = last_program._COUNTERS[(logits.device, "lm_head_argmax")]
    assert not counters.any(), "the last program resets its counter"


def test_tie_inside_one_program_takes_the_first() -> None:
    x = torch.ones(1, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(300, 64, dtype=torch.bfloat16, device=DEVICE)
    w[[7, 9, 250]] = 0.5  # equal logits: the first index wins
    _, ids = lm_head_argmax(x, w)
    assert ids.tolist() == [7]


def test_refuses_bad_shapes() -> None:
    x = torch.ones(2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError):
        lm_head_argmax(x, torch.ones(10, 32, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError):
        lm_head_argmax(torch.ones(17, 64, dtype=torch.bfloat16, device=DEVICE), x)


def test_compiles_for_hopper() -> None:
    """sm_90 compile of the PDL variants the decode graphs use (Qwen3-0.6B's and Llama-3.1-8B's
    tuned LM-head configs at one and eight rows)."""
    from hopper_variants import compile_for_hopper

    base = dict(BLOCK_M=1, BLOCK_N=128, BLOCK_K=256, NUM_STAGES=3, USE_DOT=True, EVEN_K=True,
                REDUCE=1024, PDL=True, PREFETCH_LINES=1, LINE_ELEMS=64)  # fmt: skip
    variants = [base, dict(base, BLOCK_M=8, BLOCK_N=32, BLOCK_K=512, NUM_STAGES=5),
                dict(base, USE_DOT=False, BLOCK_N=32, BLOCK_K=512, PDL=False)]  # fmt: skip
    pointers = dict(x_ptr="bf16", w_ptr="bf16", logits_ptr="fp32", part_val_ptr="fp32",
                    part_idx_ptr="i32", ids_ptr="i64", counter_ptr="i32")  # fmt: skip
    ptxs = compile_for_hopper("roofline.kernels.lm_head_argmax", "_lm_head_argmax_kernel",
                              variants, pointers, options=dict(num_warps=4))  # fmt: skip
    assert "griddepcontrol.wait" in ptxs[0] and "atom." in ptxs[0]
    assert "griddepcontrol" not in ptxs[2]
