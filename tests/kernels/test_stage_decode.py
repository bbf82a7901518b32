"""The one-launch decode input staging against its torch ops: uploaded rows, pending ids from the
previous launch, block-table rows gathered, padding rows up to the bucket."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels.stage_decode import stage_decode, stage_decode_ref


def _static(max_batch: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
    i64 = dict(dtype=torch.int64, device=DEVICE)
    return (
        torch.full((max_batch,), 7, **i64),
        torch.full((max_batch,), 9, **i64),
        torch.full((max_batch,), 11, **i64),
        torch.full((max_batch,), 13, dtype=torch.int32, device=DEVICE),
        torch.full((max_batch, max_blocks), 17, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("n,bucket,num_pending", [(1, 1, 1), (3, 4, 2), (5, 8, 0), (16, 16, 16)])
def test_matches_torch_ops(n: int, bucket: int, num_pending: int) -> None:
    gen = torch.Generator().manual_seed(n * 31 + bucket)
    max_blocks = 37
    table = torch.randint(0, 1000, (20, max_blocks), generator=gen, dtype=torch.int32).to(DEVICE)
    rand = lambda: torch.randint(0, 10_000, (n,), generator=gen).to(DEVICE)  # noqa: E731
    ids, pos, slots, lens = rand(), rand(), rand(), rand()
    rows = torch.randperm(20, generator=gen)[:n].to(DEVICE)
    pending = rand()[:num_pending] if num_pending else None
    got, want = _static(16, max_blocks), _static(16, max_blocks)
    stage_decode(ids, pos, slots, lens, rows, pending, table, got, bucket)
    stage_decode_ref(ids, pos, slots, lens, rows, pending, table, want, bucket)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_compiles_for_hopper() -> None:
    from hopper_variants import compile_for_hopper

    names = ("ids_ptr", "pos_ptr", "slots_ptr", "lens_ptr", "rows_ptr", "pending_ptr",
             "ids_out", "pos_out", "slots_out")  # fmt: skip
    pointers = dict.fromkeys(names, "i64")
    pointers.update(table_ptr="i32", lens_out="i32", table_out="i32")
    variants = [dict(MAX_BLOCKS=256, BLOCK=256)]
    module = "roofline.kernels.stage_decode"
    compile_for_hopper(module, "_stage_decode_kernel", variants, pointers, (), dict(num_warps=1))
