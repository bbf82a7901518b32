"""The pinned staging ring and the sampled ids' buffer pool (``worker/staging.py``), with plain
CPU tensors and recording events standing in for pinned memory and CUDA events: values, the
ring's reuse only after the event of a buffer's last copy (and its growth), and the pool's
reuse only of given-back buffers of a fitting size and dtype."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from roofline.worker.host_batch import upload
from roofline.worker.staging import HostIdBuffers, PinnedStaging


class _Event:
    def __init__(self, log: list) -> None:
        self.log, self.recorded = log, 0

    def record(self) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        self.log.append(self)


class _Ring(PinnedStaging):
    def __init__(self, num_buffers: int = 3) -> None:
        super().__init__(torch.device("cpu"), num_buffers)
        self.waits: list[_Event] = []
        self.allocated: list[int] = []

    def _new_buffer(self, size: int) -> torch.Tensor:
        self.allocated.append(size)
        return torch.empty(size, dtype=torch.int64)

    def _new_event(self) -> _Event:  # type: ignore[override]
        return _Event(self.waits)


def test_ring_carries_the_values_and_waits_before_reuse() -> None:
    ring = _Ring(3)
    rng = random.Random(0)
    for step in range(10):
        n = rng.choice([0, 1, 5, 300, 20000, 70000])
        values = [rng.randrange(-(1 << 62), 1 << 62) for _ in range(n)]
        out = ring.to_device(array("q", values))
        assert out.tolist() == values
        # the buffer used now was last used 3 steps ago: its event was waited on first
        assert len(ring.waits) == max(0, step - 2)
    assert all(size >= 16384 for size in ring.allocated) and len(ring.allocated) >= 3
    assert all(e.recorded for e in ring.waits)
    with pytest.raises(ValueError):
        ring.to_device(array("i", [1]))
    with pytest.raises(ValueError):
        PinnedStaging(torch.device("cpu"), 1)


def test_upload_through_the_ring_matches_the_plain_upload() -> None:
    ring = _Ring(2)
    lists = [[1, 2, 3], [], [7] * 40, [-5]]
    # (on the CPU ``upload`` never stages: call the ring the way it does on CUDA)
    joined = [v for values in lists for v in values]
    assert (
        ring.to_device(array("q", joined)).tolist()
        == torch.cat(upload(lists, ring.device)).tolist()
    )


class _Pool(HostIdBuffers):
    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def _new(self, size: int, dtype: torch.dtype):  # type: ignore[override]
        self.made += 1
        return torch.empty(size, dtype=dtype), object()


def test_id_pool_reuses_only_given_back_fitting_buffers() -> None:
    pool = _Pool()
    a = pool.take(10, torch.int64)
    b = pool.take(10, torch.int64)
    assert pool.made == 2 and a[0] is not b[0] and a[0].numel() == 256
    pool.give_back(a)
    got = pool.take(200, torch.int64)  # given back, fits
    assert got[0] is a[0] and got[1] is a[1]
    assert pool.made == 2
    pool.give_back(b)
    c = pool.take(1000, torch.int64)  # too small: dropped, a new one made
    assert c[0].numel() == 1000 and pool.made == 3
    pool.give_back(c)
    d = pool.take(4, torch.int32)  # another dtype: a new one
    assert d[0].dtype == torch.int32 and pool.made == 4
