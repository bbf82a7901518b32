"""The one-launch steady decode advance against its torch ops: block-table updates of the
step's rows (none, some, one per row), each real row one token further with its slot from the
updated table, padding rows up to the bucket, and the greedy ids copied in or not."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels.steady_advance import steady_advance, steady_advance_ref


def _state(seed: int, n: int, bucket: int, num_updates: int, page: int) -> tuple:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    max_blocks, num_table_rows, cap = 13, 24, 16
    table = torch.randint(0, 900, (num_table_rows, max_blocks), generator=gen, dtype=torch.int32)
    rows = rng.sample(range(num_table_rows), n) + [rng.randrange(num_table_rows)] * (cap - n)
    positions = [rng.randrange(page * (max_blocks - 2)) for _ in range(cap)]
    lens = [p + 1 if i < n else 1 for i, p in enumerate(positions)]
    slots = [rng.randrange(9999) for _ in range(cap)]
    # updates: a new page in the column each updated row's next position reaches
    updated = rng.sample(range(n), num_updates)
    flat = [rows[i] * max_blocks + (positions[i] + 1) // page for i in updated]
    pages = [rng.randrange(900) for _ in updated]
    updates = torch.randint(0, 50, (1 + 2 * cap,), generator=gen)  # stale past the packed ones
    updates[: 1 + 2 * num_updates] = torch.tensor([num_updates, *flat, *pages], dtype=torch.int64)
    block_table = torch.randint(0, 900, (cap, max_blocks), generator=gen, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    static = (torch.tensor(positions), torch.tensor(slots), lens_t, block_table)
    ids = (torch.zeros(cap, dtype=torch.int64), torch.randint(0, 500, (cap,), generator=gen))
    tensors = (static, torch.tensor(rows), torch.tensor([n]), updates, table, ids)
    return tuple(_to(t) for t in tensors)


def _to(t):
    if isinstance(t, tuple):
        return tuple(_to(x) for x in t)
    return t.to(DEVICE)


@pytest.mark.parametrize(
    "n,bucket,num_updates,page,with_ids",
    [(1, 1, 0, 16, False), (1, 1, 1, 16, True), (3, 4, 2, 4, False), (5, 8, 5, 2, True),
     (16, 16, 7, 16, True), (9, 16, 0, 16, False)],
)  # fmt: skip
def test_matches_torch_ops(n: int, bucket: int, num_updates: int, page: int, with_ids: bool):
    got = _state(n * 7 + num_updates, n, bucket, num_updates, page)
    want = _state(n * 7 + num_updates, n, bucket, num_updates, page)
    for state, fn in ((got, steady_advance), (want, steady_advance_ref)):
        static, rows, num_rows, updates, table, ids = state
        view = tuple(t[:bucket] for t in static)
        fn(view, rows, num_rows, updates, table, page, (ids[0][:bucket], ids[1][:bucket])
           if with_ids else None)  # fmt: skip
    g_static, _, _, _, g_table, g_ids = got
    w_static, _, _, _, w_table, w_ids = want
    assert torch.equal(g_table, w_table)
    assert torch.equal(g_ids[0], w_ids[0])
    for g, w in zip(g_static[:3], w_static[:3], strict=True):
        assert torch.equal(g[:bucket], w[:bucket])
    assert torch.equal(g_static[3][:n], w_static[3][:n])  # padding rows' tables: not read


def test_compiles_for_hopper() -> None:
    from hopper_variants import compile_for_hopper

    pointers = dict.fromkeys(("pos_ptr", "slots_ptr", "ids_ptr", "ids_src", "rows_ptr",
                              "num_rows_ptr", "upd_ptr"), "i64")  # fmt: skip
    pointers.update(lens_ptr="i32", table_out="i32", table_ptr="i32")
    variants = [dict(PAGE=16, MAX_BLOCKS=128, BLOCK=128, HAS_IDS=h) for h in (False, True)]
    compile_for_hopper("roofline.kernels.steady_advance", "_steady_advance_kernel", variants,
                       pointers, (), dict(num_warps=1))  # fmt: skip
