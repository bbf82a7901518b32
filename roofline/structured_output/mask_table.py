"""The host side of per-step grammar masks: one bitmask slot per live constrained sequence,
refilled only when its matcher moved, filled off the step's critical path, uploaded once.

* **Slots.** Each matcher owns a row ("slot") of one pinned int32 table for its whole life; the
  lowest free slot is reused, so the table's used prefix stays about as long as the number of
  live matchers. A slot is refilled only when its matcher advanced since the last fill (a row
  in chunked prefill, or whose token the grammar refused, keeps its mask; a terminated matcher
  is never filled).
* **Filling.** :meth:`start_fill` runs as soon as a step's tokens are accepted: cheap fills run
  inline; fills expected to cost more than ``INLINE_FILL_S`` go to a worker thread (the grammar
  library releases the GIL), so they overlap the engine's detokenizing and output building,
  and :meth:`finish_fill` joins them just before the masks are needed (anything that moves a
  matcher joins a running fill first). Rows whose single-thread fill costs more than
  ``THREADED_ROW_S`` (long regex repetitions, where most tokens stay uncertain) are split over
  ``max_threads`` library threads; cheap rows use one thread (a hand-off to library threads
  costs more than a cheap row: ~1.4 ms vs ~3 us measured on two cores, and xgrammar's "auto"
  thread count cost 3-4 ms a step on a 16-core GPU host).
* **Upload.** The table is laid out as ``[pairs | bitmask]`` in one flat buffer: the (logits
  row, slot) pairs of this step, then the slots. One copy on a side stream (overlapping the
  forward) moves ``pairs + used slots`` to the device and one fused kernel
  (:mod:`roofline.kernels.token_bitmask`) masks the named rows in place. On the CPU the
  backend's own masking kernel is used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from roofline.structured_output.backend import GrammarMatcher, StructuredOutputBackend

INLINE_FILL_S = 1e-3
"""Expected fill time under which :meth:`MaskTable.start_fill` fills inline."""
THREADED_ROW_S = 5e-4
"""Single-thread fill time per row from which a step's rows are split over library threads
(a hand-off to them cost ~1.4 ms on the 2-core dev machine: worth it for long regex
repetitions, at ~1-10 ms a row, not for JSON schemas, at ~3 us)."""
_EMA = 0.3


class MaskTable:
    def __init__(
        self, backend: StructuredOutputBackend, initial_slots: int = 16, fused: bool | None = None
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.vocab_size  # type: ignore[attr-defined]
        self.words_per_row = (self.vocab_size + 31) // 32
        self.max_threads = max(1, min(8, len(os.sched_getaffinity(0))))
        self._pin = torch.cuda.is_available()
        self._fused = fused
        """Mask with the fused kernel (default: when the logits are on a GPU)."""
        self._capacity = 0
        self._flat = torch.empty(0, dtype=torch.int32)
        self._device_flat: Tensor | None = None
        self._copy_stream: Any = None  # torch.cuda.Stream of the uploads
        self._copied: Any = None  # torch.cuda.Event: the step's upload landed
        self._masked: Any = None  # torch.cuda.Event: the last masking kernel is queued/done
        self._free: set[int] = set()
        self._next_slot = 0
        self._dirty: dict[int, GrammarMatcher] = {}
        self._scratch: list[int] = []  # slots of speculative positions, this step only
        self._row_fill_s = 0.0  # EMA of the fill time per row
        self._pool: ThreadPoolExecutor | None = None
        self._fill: Future | None = None
        self.fill_s = 0.0
        """Seconds spent filling, wherever the fill ran (benchmarks read these three)."""
        self.apply_s = 0.0
        """Seconds in :meth:`apply` (waiting for the fill, the upload, the kernel launch): the
        masks' part of the step's critical path."""
        self.num_applies = 0
        self._grow(initial_slots)

    # ----------------------------------------------------------------- layout
    def _grow(self, capacity: int) -> None:
        self.finish_fill()
        old_bitmask = self.bitmask if self._capacity else None
        flat = torch.empty(2 * capacity + capacity * self.words_per_row, dtype=torch.int32)
        if self._pin:
            flat = flat.pin_memory()
        self._flat, self._capacity = flat, capacity
        if old_bitmask is not None:
            self.bitmask[: old_bitmask.shape[0]].copy_(old_bitmask)
        self._device_flat = None

    @property
    def bitmask(self) -> Tensor:
        """The host table, ``[capacity, words]`` (a view of the flat buffer)."""
        start = 2 * self._capacity
        return self._flat[start:].view(self._capacity, self.words_per_row)

    @property
    def num_slots_used(self) -> int:
        return self._next_slot

    # ----------------------------------------------------------------- slots
    def _take_slot(self) -> int:
        """The lowest free slot, else a new one at the end of the used prefix (growing the
        table when it is full)."""
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
            return slot
        slot = self._next_slot
        self._next_slot += 1
        if slot >= self._capacity:
            self._grow(2 * self._capacity)
        return slot

    def acquire(self, matcher: GrammarMatcher) -> int:
        """A slot for a new matcher (filled before its first masked step)."""
        slot = self._take_slot()
        self._dirty[slot] = matcher
        return slot

    def release(self, slot: int) -> None:
        self._dirty.pop(slot, None)
        self._free.add(slot)
        while self._next_slot - 1 in self._free:  # keep the used prefix short
            self._next_slot -= 1
            self._free.remove(self._next_slot)

    def fill_scratch(self, matcher: GrammarMatcher) -> int:
        """Fill a temporary slot from ``matcher``'s state now (a speculative position's mask);
        the slot is released after the next :meth:`apply` has queued its upload."""
        slot = self._take_slot()
        matcher.fill_bitmask(self.bitmask, slot)
        self._scratch.append(slot)
        return slot

    def mark_dirty(self, slot: int, matcher: GrammarMatcher) -> None:
        """The matcher moved: its slot must be refilled before its next masked step."""
        self._dirty[slot] = matcher

    # ----------------------------------------------------------------- filling
    def start_fill(self) -> None:
        """Fill the dirty slots now (cheap) or on the worker thread (expensive)."""
        if not self._dirty or self._fill is not None:
            return
        slots: list[int] = []
        matchers: list[GrammarMatcher] = []
        for slot, matcher in self._dirty.items():
            if not matcher.is_terminated():  # a finished grammar's row is never masked
                slots.append(slot)
                matchers.append(matcher)
        self._dirty = {}
        if not slots:
            return
        if self._row_fill_s * len(slots) < INLINE_FILL_S:
            self._run_fill(matchers, slots)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        self._fill = self._pool.submit(self._run_fill, matchers, slots)

    def _run_fill(self, matchers: Sequence[GrammarMatcher], slots: list[int]) -> None:
        expensive = self._row_fill_s >= THREADED_ROW_S and len(slots) > 1
        threads = min(self.max_threads, len(slots)) if expensive else 1
        t0 = time.perf_counter()
        if len(slots) == 1:
            matchers[0].fill_bitmask(self.bitmask, slots[0])
        else:
            self.backend.fill_rows(matchers, self.bitmask, slots, threads)
        elapsed = time.perf_counter() - t0
        self.fill_s += elapsed
        per_row = elapsed * threads / len(slots)  # single-thread equivalent, overhead included
        self._row_fill_s = (
            per_row if not self._row_fill_s else ((1 - _EMA) * self._row_fill_s + _EMA * per_row)
        )

    def wait_fill(self) -> None:
        """Join a fill running on the worker thread (before a matcher it reads may change)."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill.result()

    def finish_fill(self) -> None:
        """Every dirty slot is filled when this returns."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill.result()
        if self._dirty:
            self.start_fill()
            if self._fill is not None:
                fill, self._fill = self._fill, None
                fill.result()

    # ----------------------------------------------------------------- masking
    def apply(self, logits: Tensor, rows: Sequence[int], slots: Sequence[int]) -> None:
        """Mask ``logits[rows[i]]`` ([R, V]) by slot ``slots[i]``, in place."""
        t0 = time.perf_counter()
        self._apply(logits, rows, slots)
        for slot in self._scratch:
            self.release(slot)
        self._scratch = []
        self.apply_s += time.perf_counter() - t0
        self.num_applies += 1

    def _apply(self, logits: Tensor, rows: Sequence[int], slots: Sequence[int]) -> None:
        self.finish_fill()
        num = len(rows)
        if not (logits.is_cuda if self._fused is None else self._fused):
            bitmask = self.bitmask
            sub_mask = bitmask[list(slots)] if list(slots) != list(range(num)) else bitmask[:num]
            if num == logits.shape[0] and list(rows) == list(range(num)):
                self.backend.apply_bitmask(logits, sub_mask)
                return
            index = torch.tensor(rows)  # [C]
            sub = logits.index_select(0, index)  # [C, V]
            self.backend.apply_bitmask(sub, sub_mask)
            logits.index_copy_(0, index, sub)
            return
        from roofline.kernels.token_bitmask import apply_packed_bitmask

        if num > self._capacity:
            self._grow(max(num, 2 * self._capacity))
        pairs = self._flat[: 2 * num].view(num, 2)  # [C, 2]
        pairs[:, 0] = torch.as_tensor(rows, dtype=torch.int32)
        pairs[:, 1] = torch.as_tensor(slots, dtype=torch.int32)
        used = 2 * self._capacity + self._next_slot * self.words_per_row
        if self._device_flat is None or self._device_flat.device != logits.device:
            self._device_flat = self._device_buffer(logits.device)
        if not logits.is_cuda:  # the Triton interpreter (tests)
            self._device_flat[:used].copy_(self._flat[:used])
        else:
            # The upload runs on a side stream, so it overlaps the forward still running on the
            # main stream (whose work it would otherwise queue behind); the main stream waits
            # for it only before the masking kernel. The host buffer is next written after the
            # step's sampled ids reached the host, so after this copy completed.
            main = torch.cuda.current_stream(logits.device)
            with torch.cuda.stream(self._copy_stream):
                if self._masked is not None:  # the last kernel read this buffer: after it
                    self._copy_stream.wait_event(self._masked)
                self._device_flat[:used].copy_(self._flat[:used], non_blocking=True)
                self._copied.record(self._copy_stream)
            main.wait_event(self._copied)
        apply_packed_bitmask(
            logits,
            self._device_flat,
            num,
            self._capacity,
            self.words_per_row,
            self.vocab_size,
        )
        if logits.is_cuda:
            if self._masked is None:
                self._masked = torch.cuda.Event()
            self._masked.record(torch.cuda.current_stream(logits.device))

    def _device_buffer(self, device: torch.device) -> Tensor:
        """The device copy of the flat table. On CUDA it is allocated *on the copy stream*:
        the caching allocator hands a stream a block freed on that same stream, ordered after
        that stream's work. Allocated on the main stream, it could be a block whose last
        kernels (the step's forward, queued behind the step still running) have not run yet,
        which the upload on the copy stream would overwrite under them: the illegal memory
        accesses of constrained 8B steps under mixed-step graphs (never with launch blocking,
        nor on models whose steps are short). The masking kernels read it on the main stream,
        so the block is kept from reuse until they are done (``record_stream``)."""
        if device.type != "cuda":
            return torch.empty_like(self._flat, device=device)
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device=device)
            self._copied = torch.cuda.Event()
            self._masked = None
        with torch.cuda.stream(self._copy_stream):
            buf = torch.empty_like(self._flat, device=device)
        buf.record_stream(torch.cuda.current_stream(device))
        return buf

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
