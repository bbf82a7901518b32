"""The fused packed-bitmask kernel against its torch reference and xgrammar's own kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU

from roofline.kernels.token_bitmask import apply_packed_bitmask, apply_token_bitmask_ref

VOCAB = 128256 if ON_GPU else 5000


def _packed(pairs: list[tuple[int, int]], bitmask: torch.Tensor, capacity: int) -> torch.Tensor:
    flat = torch.zeros(2 * capacity + bitmask.numel(), dtype=torch.int32)
    flat[: 2 * len(pairs)] = torch.tensor(pairs, dtype=torch.int32).flatten()
    flat[2 * capacity :] = bitmask.flatten()
    return flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [VOCAB, VOCAB + 70])  # logits padded past the vocabulary
def test_packed_bitmask_matches_reference(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(0)
    words = (VOCAB + 31) // 32
    num_slots, num_rows = 6, 5
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_slots, words), generator=gen).int()
    bitmask[2] = 0  # a slot allowing nothing
    bitmask[3] = -1  # a slot allowing everything
    logits = torch.randn(num_rows, width, generator=gen).to(dtype)  # [R, V']
    pairs = [(0, 5), (2, 2), (3, 3), (4, 0)]  # row 1 is unconstrained
    expected = logits.clone()
    apply_token_bitmask_ref(expected, torch.tensor(pairs, dtype=torch.int32), bitmask, VOCAB)
    actual = logits.to(DEVICE)
    packed = _packed(pairs, bitmask, capacity=num_slots).to(DEVICE)
    apply_packed_bitmask(actual, packed, len(pairs), num_slots, words, VOCAB)
    assert torch.equal(actual.cpu(), expected)
    assert torch.equal(actual[1].cpu(), logits[1])  # untouched
    assert torch.isinf(actual[2].cpu()).all()


def test_reference_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(1)
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen).int()
    logits = torch.randn(3, VOCAB, generator=gen)  # [3, V]
    ours = logits.clone()
    apply_token_bitmask_ref(ours, torch.tensor([[0, 0], [1, 1], [2, 2]]).int(), bitmask, VOCAB)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=VOCAB)
    assert torch.equal(ours, theirs)


def test_mask_table_packed_path_matches_matchers() -> None:
    """The mask table's one-upload path: slots refilled only when moved, rows named by pairs."""
    xgr = pytest.importorskip("xgrammar")
    from roofline.structured_output.bench import synthetic_backend
    from roofline.structured_output.mask_table import MaskTable
    from roofline.structured_output.params import StructuredOutputsParams

    backend = synthetic_backend(VOCAB, 7)
    compiled = backend.compile(StructuredOutputsParams(choice=["alpha", "beta", "gamma"]))
    table = MaskTable(backend, initial_slots=2, fused=True)
    matchers = [backend.matcher(compiled) for _ in range(3)]
    slots = [table.acquire(m) for m in matchers]  # grows past 2 slots
    assert slots == [0, 1, 2]
    table.start_fill()
    assert matchers[1].accept_token(ord("a"))  # the synthetic vocabulary's single bytes
    table.mark_dirty(1, matchers[1])
    table.finish_fill()
    logits = torch.randn(4, VOCAB).to(DEVICE)  # row 3 unconstrained
    expected = logits.cpu().clone()
    direct = xgr.allocate_token_bitmask(3, VOCAB)
    for i, m in enumerate(matchers):
        m.fill_bitmask(direct, i)
    rows = [2, 0, 1]  # logits row i <- matcher slots[rows.index(i)]
    pairs = torch.tensor([[r, s] for r, s in zip(rows, slots)], dtype=torch.int32)
    apply_token_bitmask_ref(expected, pairs, direct, VOCAB)
    table.apply(logits, rows, slots)
    assert torch.equal(logits.cpu(), expected)
    table.release(2)
    table.release(1)
    assert table.num_slots_used == 1
    assert table.acquire(matchers[1]) == 1
