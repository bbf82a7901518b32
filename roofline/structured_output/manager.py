"""The engine's side of structured outputs: compiles constraints off the step loop, keeps one
matcher per constrained sequence, and masks the logits of a step's constrained rows.

* **Compiling.** :meth:`StructuredOutputManager.submit` hands a constraint to a worker thread
  and returns a future; futures are cached by the constraint's key (an LRU of
  ``MAX_CACHED_GRAMMARS``), so equal constraints compile once and ``n > 1`` sequences share one
  grammar. The engine keeps a request out of the scheduler until its future is done, so a
  request waiting for its grammar never holds up other requests' steps.
* **Matching.** :meth:`start` gives each sequence its matcher; :meth:`accept` advances it on the
  tokens the scheduler confirmed (dropped tokens of finished requests never reach it). A
  preempted request keeps its output tokens (it recomputes their KV), so its matcher stays
  valid; no rollback is needed for preemption or prefix caching.
* **Masking.** :meth:`mask_logits` is called by the runner between the LM head and the sampler
  (with async scheduling, after the previous step's tokens were accepted: the host fills the
  bitmask while the device runs this step's forward). Only rows whose request has a live
  matcher are filled, copied and masked; a step without such rows costs one dict lookup per
  row, and the engine passes no callback at all while no matcher exists.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import Tensor

from roofline.request import Request
from roofline.structured_output.backend import GrammarMatcher, StructuredOutputBackend, make_backend
from roofline.structured_output.mask_table import MaskTable
from roofline.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend: str | StructuredOutputBackend = "auto",
        max_rollback_tokens: int = 0,
    ) -> None:
        if isinstance(backend, StructuredOutputBackend):  # built by the caller (benchmarks)
            self.backend = backend
        elif tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        else:
            self.backend = make_backend(backend, tokenizer, vocab_size, stop_token_ids)
        self.max_rollback_tokens = max_rollback_tokens
        """How far matchers can roll back (speculative decoding sets its proposal length)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._matchers: dict[str, GrammarMatcher] = {}
        self._slots: dict[str, int] = {}  # request id -> its row of the mask table
        self.masks = MaskTable(self.backend)

    # ----------------------------------------------------------------- compiling
    def validate(self, params: StructuredOutputsParams) -> None:
        """``ValueError`` for a constraint the backend refuses; skipped when an equal one is
        compiled or compiling already (it was validated then: ~0.3 ms a request saved)."""
        future = self._futures.get(params.key)
        if future is not None and not (future.done() and future.exception() is not None):
            return
        self.backend.validate(params)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's future (shared by equal constraints)."""
        key = params.key
        future = self._futures.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._futures.move_to_end(key)
            return future
        future = self._pool.submit(self.backend.compile, params)
        self._futures[key] = future
        while len(self._futures) > MAX_CACHED_GRAMMARS:
            self._futures.popitem(last=False)
        return future

    # ----------------------------------------------------------------- matchers
    @property
    def has_matchers(self) -> bool:
        return bool(self._matchers)

    def start(self, request_ids: Iterable[str], compiled: Any) -> None:
        for request_id in request_ids:
            matcher = self.backend.matcher(compiled, self.max_rollback_tokens)
            self._matchers[request_id] = matcher
            self._slots[request_id] = self.masks.acquire(matcher)

    def matcher(self, request_id: str) -> GrammarMatcher | None:
        """The sequence's matcher (speculative decoding checks proposals against it)."""
        return self._matchers.get(request_id)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Advance the sequence's matcher over its confirmed tokens (its mask slot is refilled
        at the next :meth:`start_fill`)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not token_ids:
            return
        self.masks.wait_fill()  # the worker may still be reading this matcher
        moved = False
        for token_id in token_ids:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                logger.warning("request %s: token %d rejected by its grammar", request_id, token_id)
                break
            moved = True
        if moved:
            self.masks.mark_dirty(self._slots[request_id], matcher)

    def start_fill(self) -> None:
        """Begin filling the masks of the matchers that moved (after a step's tokens were all
        accepted; the fill overlaps whatever the host does until :meth:`mask_logits`)."""
        self.masks.start_fill()

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            if self._matchers.pop(request_id, None) is not None:
                self.masks.release(self._slots.pop(request_id))

    # ----------------------------------------------------------------- masking
    def check_proposals(self, requests: Iterable[Request]) -> None:
        """Cut each constrained request's speculative proposal at its first token the grammar
        forbids (the matcher is left where it was)."""
        get = self._matchers.get
        self.masks.wait_fill()  # the worker may still be reading these matchers
        for request in requests:
            draft = request.spec_token_ids
            if not draft:
                continue
            matcher = get(request.request_id)
            if matcher is None:
                continue
            valid = 0 if matcher.is_terminated() else matcher.count_valid_prefix(draft)
            del draft[valid:]

    def mask_logits(self, logits: Tensor, requests: Sequence[Request]) -> None:
        """Mask, in place, the rows of ``logits`` ([R, V]) whose request is constrained. A
        request verifying a proposal of ``k`` tokens owns ``1 + k`` consecutive rows: row ``j``
        gets the mask of its grammar after the proposal's first ``j`` tokens (filled here, the
        matcher rolled back after)."""
        rows: list[int] = []
        slots: list[int] = []
        get = self._matchers.get
        row = 0
        for request in requests:
            draft = request.spec_token_ids
            matcher = get(request.request_id)
            if matcher is not None and not matcher.is_terminated():
                rows.append(row)
                slots.append(self._slots[request.request_id])
                if draft:
                    rows_, slots_ = self._draft_masks(matcher, draft, row)
                    rows += rows_
                    slots += slots_
            row += 1 + len(draft)
        if rows:
            self.masks.apply(logits, rows, slots)

    def _draft_masks(
        self, matcher: GrammarMatcher, draft: Sequence[int], row: int
    ) -> tuple[list[int], list[int]]:
        self.masks.finish_fill()  # the fill may still read this matcher on the worker thread
        rows: list[int] = []
        slots: list[int] = []
        accepted = 0
        for j, token_id in enumerate(draft):
            if not matcher.accept_token(token_id):  # check_proposals cut such drafts already
                break
            accepted += 1
            if matcher.is_terminated():  # a stop token: nothing follows it
                break
            rows.append(row + j + 1)
            slots.append(self.masks.fill_scratch(matcher))
        if accepted:
            matcher.rollback(accepted)
        return rows, slots

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.masks.shutdown()
