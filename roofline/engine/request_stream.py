"""The API process's view of one request: a :class:`RequestStream` of delta outputs that merges
what its consumer has not read yet (:func:`merge_into`), so a consumer that falls behind gets one
bigger delta and never loses text. Fed on its event loop by :mod:`roofline.engine.async_engine`.
"""

from __future__ import annotations

import asyncio

from roofline.outputs import RequestOutput


def merge_into(acc: RequestOutput, new: RequestOutput) -> None:
    """Append delta ``new`` to delta ``acc`` (both of one request; ``acc``'s lists are owned by
    the stream): text, token ids and logprobs concatenate, the rest is ``new``'s."""
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            acc.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    acc.finished = new.finished
    acc.metrics = new.metrics
    acc.num_cached_tokens = new.num_cached_tokens
    acc.error = new.error or acc.error
    if new.prompt_logprobs is not None:
        acc.prompt_logprobs = new.prompt_logprobs


class RequestStream:
    """The delta outputs of one request, consumed on its event loop with ``async for``.

    Deltas not yet read are merged into one. Iteration ends after the finished output, or
    raises the error the engine reported for this request."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
        final_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.final_only = final_only
        """Merge everything into one output and wake the consumer only when it has finished."""
        self.added: asyncio.Future[None] = loop.create_future()
        """Settled when the core accepted (or refused) the request."""
        self.accepted = False
        """Set on the reader thread when the core accepted it."""
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        """True once the final output (or an error) was handed to the consumer."""

    def put(self, output: RequestOutput) -> None:  # event-loop thread only
        if self._pending is None:
            output.prompt = self.prompt
            output.prompt_token_ids = self.prompt_token_ids
            self._pending = output
        else:
            merge_into(self._pending, output)
        if output.finished or not self.final_only:
            self._event.set()

    def fail(self, error: BaseException) -> None:  # event-loop thread only
        if not self.added.done():
            self.added.set_exception(error)
            self.added.exception()  # retrieved: no "never retrieved" warning if unawaited
        self._error = error
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._event.wait()  # set: an output to hand out, or an error
        if self._pending is not None:
            output, self._pending = self._pending, None
            if self._error is None:
                self._event.clear()
            if output.finished:
                self.finished = True
            return output
        self.finished = True
        assert self._error is not None
        raise self._error
