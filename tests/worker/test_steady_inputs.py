"""``steady_inputs.advance_inputs`` (a steady decode step moved on inside the decode graphs'
buffers) against staging that step from scratch (``stage_decode_ref``): random batches over a
block table, each request one token further, some reaching a new page (block-table updates
applied first), padding rows past the real ones; every buffer must match."""

from __future__ import annotations

import random

import pytest
import torch

from roofline.kernels.stage_decode import stage_decode_ref
from roofline.worker.steady_inputs import advance_inputs, write_updates


@pytest.mark.parametrize("seed", range(5))
def test_advance_matches_staging_the_next_step(seed: int) -> None:
    rng = random.Random(seed)
    page, max_blocks, num_table_rows = rng.choice([2, 4, 16]), 12, 24
    n, bucket = rng.randint(1, 16), 16
    table = torch.randint(0, 500, (num_table_rows, max_blocks), dtype=torch.int32)
    rows = rng.sample(range(num_table_rows), n)
    starts = [rng.randrange(0, page * (max_blocks - 4)) for _ in range(n)]
    i64 = torch.int64

    def static() -> tuple[torch.Tensor, ...]:
        return (torch.zeros(bucket, dtype=i64), torch.zeros(bucket, dtype=i64),
                torch.full((bucket,), -1, dtype=i64), torch.ones(bucket, dtype=torch.int32),
                torch.zeros(bucket, max_blocks, dtype=torch.int32))  # fmt: skip

    def stage(out: tuple[torch.Tensor, ...], positions: list[int]) -> None:
        slots = [int(table[r, p // page]) * page + p % page for r, p in zip(rows, positions)]
        stage_decode_ref(torch.zeros(n, dtype=i64), torch.tensor(positions), torch.tensor(slots),
                         torch.tensor([p + 1 for p in positions]), torch.tensor(rows), None,
                         table, out, bucket)  # fmt: skip

    got = static()
    got[1][n:].random_(0, page * max_blocks)  # stale positions in padding rows
    stage(got, starts)
    table_rows = torch.tensor(rows + [rng.randrange(num_table_rows) for _ in range(bucket - n)])
    for _ in range(3 * page):
        starts = [s + 1 for s in starts]
        for r, s in zip(rows, starts):  # a row reaching a new page gets a new page id
            if s % page == 0:
                table[r, s // page] = rng.randrange(500)
        ids, pos, slots, lens, block_table = got
        advance_inputs((pos, slots, lens, block_table), table_rows, torch.tensor([n]),
                       torch.arange(bucket), table, page)  # fmt: skip
        want = static()
        stage(want, starts)
        assert torch.equal(pos[:n], want[1][:n])
        assert torch.equal(slots, want[2])
        assert torch.equal(lens, want[3])
        assert torch.equal(block_table[:n], want[4][:n])


@pytest.mark.parametrize("seed", range(4))
def test_write_updates_matches_a_direct_write(seed: int) -> None:
    """Packed ``[k, flat..., pages...]`` updates (stale values past them) written in fixed-shape
    ops: the same table as writing them one by one; k from 1 to the capacity."""
    rng = random.Random(seed)
    rows, max_blocks, capacity = 9, 7, 8
    index = torch.arange(capacity)
    for k in [1, capacity, *(rng.randint(1, capacity) for _ in range(4))]:
        table = torch.randint(0, 1000, (rows, max_blocks), dtype=torch.int32)
        want = table.clone()
        flat = rng.sample(range(rows * max_blocks), k)
        pages = [rng.randrange(1000) for _ in range(k)]
        for f, p in zip(flat, pages):
            want.view(-1)[f] = p
        updates = torch.randint(0, rows * max_blocks, (1 + 2 * capacity,))  # stale
        updates[: 1 + 2 * k] = torch.tensor([k, *flat, *pages])
        write_updates(table, updates, index)
        assert torch.equal(table, want)


def test_refuses_decode_graphs_with_an_input_it_does_not_move() -> None:
    """A buffer added to the decode graphs would go stale across steady steps: refused (the
    runner then keeps the general path)."""
    from roofline.worker.block_table import BlockTables
    from roofline.worker.cuda_graph import DecodeGraphs
    from roofline.worker.steady_inputs import SteadyInputs

    cpu = torch.device("cpu")
    graphs = DecodeGraphs(None, [], None, 8, 64, 16, cpu)  # type: ignore[arg-type]
    tables = BlockTables(8, 4, cpu)
    SteadyInputs(graphs, tables, 16)  # the buffers it knows
    graphs.rope_cache_index = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="rope_cache_index"):
        SteadyInputs(graphs, tables, 16)
