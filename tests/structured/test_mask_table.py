"""The mask table's bookkeeping with a counting fake grammar library: only slots whose matcher
moved are refilled, finished matchers never, slots are reused and the used prefix shrinks,
expensive rows go to library threads and cheap ones come back, scratch slots are released after
their step, and the CPU path masks exactly the named rows."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from roofline.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from roofline.structured_output.mask_table import THREADED_ROW_S, MaskTable

VOCAB = 100


class FakeMatcher(GrammarMatcher):
    """Allows exactly one token: its own position (mod VOCAB)."""

    def __init__(self, start: int, cost_s: float = 0.0) -> None:
        self.position = start
        self.cost_s = cost_s
        self.fills = 0
        self.done = False

    def accept_token(self, token_id: int) -> bool:
        if token_id != self.position % VOCAB:
            return False
        self.position += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        time.sleep(self.cost_s)
        self.fills += 1
        bitmask[row] = 0
        token = self.position % VOCAB
        bitmask[row, token // 32] = 1 << (token % 32) if token % 32 != 31 else -(2**31)

    def is_terminated(self) -> bool:
        return self.done


class FakeBackend(StructuredOutputBackend):
    name = "fake"
    vocab_size = VOCAB

    def __init__(self) -> None:
        self.thread_counts: list[int] = []

    def validate(self, params) -> None: ...

    def compile(self, params) -> None: ...

    def matcher(self, compiled, max_rollback_tokens: int = 0) -> GrammarMatcher:
        raise NotImplementedError

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)

    def fill_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        num_threads: int = 1,
    ) -> None:
        self.thread_counts.append(num_threads)
        super().fill_rows(matchers, bitmask, rows, num_threads)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
        allowed = bits.flatten(1)[:, : logits.shape[1]].bool()  # [R, V]
        logits.masked_fill_(~allowed, float("-inf"))


def test_only_moved_slots_refill_and_masks_name_rows() -> None:
    table = MaskTable(FakeBackend(), initial_slots=2)
    matchers = [FakeMatcher(start) for start in (5, 40, 77)]
    slots = [table.acquire(m) for m in matchers]
    table.start_fill()
    table.finish_fill()
    assert [m.fills for m in matchers] == [1, 1, 1]
    assert matchers[1].accept_token(40)
    table.mark_dirty(slots[1], matchers[1])
    matchers[2].done = True
    table.mark_dirty(slots[2], matchers[2])
    logits = torch.zeros(4, VOCAB)  # [4, V]; row 3 is unconstrained
    table.apply(logits, [2, 0], [slots[0], slots[1]])  # joins the fill first
    assert [m.fills for m in matchers] == [1, 2, 1]  # unmoved and finished rows not refilled
    assert logits[2].argmax() == 5 and torch.isinf(logits[2]).sum() == VOCAB - 1
    assert logits[0].argmax() == 41 and torch.isinf(logits[0]).sum() == VOCAB - 1
    assert torch.equal(logits[1], torch.zeros(VOCAB)) and torch.equal(logits[3], logits[1])
    assert table.num_applies == 1


def test_slots_reused_prefix_shrinks_and_scratch_released() -> None:
    table = MaskTable(FakeBackend(), initial_slots=1)
    matchers = [FakeMatcher(i) for i in range(4)]
    slots = [table.acquire(m) for m in matchers]
    assert slots == [0, 1, 2, 3] and table.num_slots_used == 4
    table.release(1)
    assert table.acquire(matchers[1]) == 1  # the lowest free slot
    table.release(3)
    table.release(2)
    assert table.num_slots_used == 2
    table.finish_fill()
    scratch = table.fill_scratch(matchers[0])
    assert scratch == 2 and table.num_slots_used == 3
    table.apply(torch.zeros(2, VOCAB), [0, 1], [0, scratch])
    assert table.num_slots_used == 2  # released once its upload was queued


def test_expensive_rows_use_threads_and_cheap_rows_come_back() -> None:
    backend = FakeBackend()
    table = MaskTable(backend, initial_slots=4)
    table.max_threads = 2
    matchers = [FakeMatcher(i, cost_s=2 * THREADED_ROW_S) for i in range(4)]
    slots = [table.acquire(m) for m in matchers]
    for _ in range(3):
        table.start_fill()
        table.finish_fill()
        for slot, m in zip(slots, matchers):
            table.mark_dirty(slot, m)
    assert backend.thread_counts[0] == 1 and backend.thread_counts[-1] == 2
    for m in matchers:
        m.cost_s = 0.0
    for _ in range(12):
        table.start_fill()
        table.finish_fill()
        for slot, m in zip(slots, matchers):
            table.mark_dirty(slot, m)
    assert backend.thread_counts[-1] == 1
    table.shutdown()
