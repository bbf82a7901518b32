"""Applying packed grammar bitmasks to a step's logits in one launch (structured outputs).

The host uploads one int32 buffer per step: ``pairs`` ([num_rows, 2]: logits row, bitmask slot)
followed by the bitmask table ([num_slots, words], bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed). One program per (pair, vocabulary block) reads its bitmask words and
writes -inf over the disallowed logits of its row, in place; rows not named in ``pairs`` (the
unconstrained requests of a mixed batch) are never touched, so no gather or scatter of logits
rows is needed. Logits columns past ``vocab_size`` (padding) are always masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device

BLOCK_TOKENS = 4096


def apply_token_bitmask_ref(
    logits: torch.Tensor,  # [R, V'] float
    pairs: torch.Tensor,  # [C, 2] int32 (logits row, slot)
    bitmask: torch.Tensor,  # [S, W] int32
    vocab_size: int,
) -> None:
    """The reference: unpack each named slot's bits and fill disallowed logits with -inf."""
    width = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    rows, slots = pairs[:, 0].long(), pairs[:, 1].long()  # [C], [C]
    bits = (bitmask[slots].unsqueeze(-1) >> shifts) & 1  # [C, W, 32]
    allowed = bits.reshape(len(rows), -1)[:, :width].bool()  # [C, W * 32 cut to V']
    if allowed.shape[1] < width:
        pad = torch.zeros(len(rows), width - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)  # [C, V']
    allowed[:, vocab_size:] = False
    sub = logits.index_select(0, rows)  # [C, V']
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    logits_stride,
    packed_ptr,
    bitmask_offset,
    words_per_row,
    vocab_size,
    width,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(packed_ptr + 2 * pair).to(tl.int64)
    slot = tl.load(packed_ptr + 2 * pair + 1).to(tl.int64)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    in_row = tokens < width
    in_vocab = tokens < vocab_size
    word = tl.load(
        packed_ptr + bitmask_offset + slot * words_per_row + tokens // 32,
        mask=in_vocab,
        other=0,
    )
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(
        logits_ptr + row * logits_stride + tokens,
        tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
        mask=in_row & ~allowed,
    )


def apply_packed_bitmask(
    logits: torch.Tensor,  # [R, V'] float, last dim contiguous
    packed: torch.Tensor,  # int32 flat: [2 * pairs_capacity] pairs, then [S, W] bitmask
    num_pairs: int,
    pairs_capacity: int,
    words_per_row: int,
    vocab_size: int,
) -> None:
    """Mask ``num_pairs`` rows of ``logits`` in place from one packed upload."""
    check_device(logits, packed)
    if num_pairs == 0:
        return
    width = logits.shape[1]
    assert logits.stride(1) == 1 and packed.dtype == torch.int32
    grid = (num_pairs, triton.cdiv(width, BLOCK_TOKENS))
    _apply_bitmask_kernel[grid](
        logits,
        logits.stride(0),
        packed,
        2 * pairs_capacity,
        words_per_row,
        vocab_size,
        width,
        BLOCK=BLOCK_TOKENS,
    )
