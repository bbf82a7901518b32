"""How ``LLMEngine`` holds constrained requests: out of the scheduler until their grammar is
compiled (on the manager's worker thread), then scheduled with one matcher per sequence.

The manager (and with it xgrammar and the tokenizer's vocabulary table) is built on the first
constrained request, so an engine that never sees one imports and pays nothing. A compile that
fails, or takes longer than ``COMPILE_TIMEOUT_S``, finishes its request with
``finish_reason="error"``; the server has already compiled the same constraint under a tighter
bound in the API process and answered 400, so this is a second line of defence.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roofline.request import RequestStatus
from roofline.structured_output.backend import StructuredOutputBackend
from roofline.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from torch import Tensor

    from roofline.engine.llm_engine import LLMEngine, _Group
    from roofline.outputs import RequestOutput
    from roofline.request import Request
    from roofline.structured_output.manager import StructuredOutputManager

COMPILE_TIMEOUT_S = 30.0
IDLE_WAIT_S = 0.01
"""How long an otherwise idle step waits for a compile to finish (instead of spinning)."""


@dataclass
class _Waiting:
    group: _Group
    future: Future
    deadline: float


class GrammarWaits:
    def __init__(self, engine: LLMEngine, backend: str | StructuredOutputBackend = "auto") -> None:
        self._engine = engine
        self._backend = backend
        self._manager: StructuredOutputManager | None = None
        self.waiting: list[_Waiting] = []

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            from roofline.structured_output.manager import StructuredOutputManager

            engine = self._engine
            self._manager = StructuredOutputManager(
                engine.tokenizer,
                engine.model_config.vocab_size,
                sorted(engine.eos_token_ids),
                self._backend,
            )
        return self._manager

    def use_backend(self, backend: StructuredOutputBackend) -> None:
        """Compile with this backend (e.g. over a synthetic vocabulary, for a model without a
        tokenizer); only before the first constrained request."""
        if self._manager is not None:
            raise RuntimeError("the structured output backend is already in use")
        self._backend = backend

    @property
    def has_matchers(self) -> bool:
        return self._manager is not None and self._manager.has_matchers

    def add(self, group: _Group, params: StructuredOutputsParams) -> None:
        """Validate (``ValueError`` on a bad constraint) and start compiling."""
        manager = self.manager
        manager.validate(params)
        future = manager.submit(params)
        self.waiting.append(_Waiting(group, future, time.monotonic() + COMPILE_TIMEOUT_S))

    def admit_ready(self, idle: bool) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready; finish those whose compile failed."""
        if idle and not any(w.future.done() for w in self.waiting):
            wait([w.future for w in self.waiting], IDLE_WAIT_S, FIRST_COMPLETED)
        engine, outputs, still = self._engine, [], []
        now = time.monotonic()
        for w in self.waiting:
            if not w.future.done():
                if now < w.deadline:
                    still.append(w)
                    continue
                error: BaseException | None = TimeoutError("grammar compilation timed out")
            else:
                error = w.future.exception()
            group = w.group
            if error is None:
                self.start(group, w.future.result())
                engine._schedule_group(group)
                continue
            for seq in group.seqs:
                seq.status = RequestStatus.FINISHED_ERROR
                seq.stop_reason = str(error)
            outputs.append(engine._make_output(group))
            engine._drop(group)
        self.waiting = still
        return outputs

    def start(self, group: _Group, compiled: Any) -> None:
        self.manager.start([s.request_id for s in group.seqs], compiled)
        group.constrained = True

    def discard(self, group: _Group) -> None:
        self.waiting = [w for w in self.waiting if w.group is not group]

    def remove(self, group: _Group) -> None:
        if self._manager is not None:
            self._manager.remove(s.request_id for s in group.seqs)

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        if self._manager is not None:
            self._manager.accept(request_id, token_ids)

    def check_proposals(self, requests: list[Request]) -> None:
        if self._manager is not None:
            self._manager.check_proposals(requests)

    def start_fill(self) -> None:
        if self._manager is not None:
            self._manager.start_fill()

    def mask_logits(self, logits: Tensor, requests: list[Request]) -> None:
        if self._manager is not None:
            self._manager.mask_logits(logits, requests)
