"""The asyncio face of the synchronous ``LLMEngine``, used by the OpenAI server.

One background thread owns the engine: it alone calls into it (the engine is not thread-safe),
running ``step()`` while requests are unfinished and sleeping on a condition otherwise. The
event loop talks to it through a command queue: ``add_request``, ``abort`` and
``run_in_engine`` (tokenizer and chat-template work) are executed by the thread between steps
and their results come back through asyncio futures. Each request's outputs flow through its
own :class:`RequestStream`; outputs are cumulative, so a slow consumer simply sees the latest
one. Invalid requests fail in ``add_request`` and never touch the loop; if ``step()`` itself
raises, the engine is marked dead: every pending request gets :class:`EngineDeadError`, health
checks fail and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roofline.engine.args import EngineArgs
    from roofline.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop stopped after an error; nothing more can be served."""


class EngineObserver(Protocol):
    """Receives what the step loop sees (the server's Prometheus metrics implement it).

    All methods are called on the engine thread and must be quick and never raise."""

    def on_added(self, request_id: str, arrival_time: float) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_id: str, now: float) -> None: ...

    def on_stats(self, stats: Any) -> None: ...


@dataclass
class _Command:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[Any] | None = None


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy whose lists the engine can no longer mutate (it runs on another thread)."""
    outs = [
        replace(
            c,
            token_ids=list(c.token_ids),
            logprobs=None if c.logprobs is None else list(c.logprobs),
        )
        for c in output.outputs
    ]
    metrics = None if output.metrics is None else replace(output.metrics)
    return replace(output, outputs=outs, metrics=metrics)


class RequestStream:
    """The outputs of one request, consumed on the event loop with ``async for``.

    Only the latest output is kept (they are cumulative). Iteration ends after the finished
    output, or raises the error the engine reported for this request."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        """True once the final output (or an error) was handed to the consumer."""

    def put(self, output: RequestOutput) -> None:  # event-loop thread only
        self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:  # event-loop thread only
        self._error = error
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            await self._event.wait()
            self._event.clear()
        if self._latest is not None:
            output, self._latest = self._latest, None
            if output.finished:
                self.finished = True
            return output
        self.finished = True
        assert self._error is not None
        raise self._error


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` on a background thread and serves it to asyncio code."""

    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._dead_error: BaseException | None = None
        self._stats: Any = None
        self._thread = threading.Thread(target=self._run, name="roofline-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, observer: EngineObserver | None = None
    ) -> AsyncLLMEngine:
        from roofline.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), observer)

    # ----------------------------------------------------------------- read-only facts
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or not self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def get_stats(self) -> Any:
        """The engine's ``EngineStats`` as of the end of the last loop iteration."""
        return self._stats

    @property
    def num_active_streams(self) -> int:
        with self._cond:
            return len(self._streams)

    # ----------------------------------------------------------------- event-loop API
    def _check_alive(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"the engine loop is dead: {self._dead_error!r}")

    def _submit(self, command: _Command) -> None:
        with self._cond:
            self._check_alive()
            self._commands.append(command)
            self._cond.notify()

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(_Command(lambda: fn(self.engine), loop, future))
        return await future

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; raises what ``LLMEngine.add_request`` raises (``ValueError`` for
        bad input, ``QueueFullError``) or :class:`EngineDeadError`."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        arrival = time.monotonic()

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, priority, arrival)
            if self.observer is not None:
                self.observer.on_added(request_id, arrival)

        future: asyncio.Future[None] = loop.create_future()
        try:
            self._submit(_Command(add, loop, future))
            await future
        except BaseException:
            # Failed or cancelled: drop the stream; an add that did run is undone by an abort.
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's (cumulative) outputs until it finishes; aborts it if the
        consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; callable from any thread, never blocks on a step)."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if self.is_dead:
                return
            self._commands.append(_Command(lambda: self._abort_on_thread(request_id, stream)))
            self._cond.notify()

    def _abort_on_thread(self, request_id: str, stream: RequestStream | None) -> None:
        self.engine.abort_request(request_id)
        if stream is not None and self.observer is not None:
            self.observer.on_aborted(request_id, time.monotonic())

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        has_work = False
        try:
            while True:
                with self._cond:
                    while not (self._commands or has_work or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._execute(command)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs, time.monotonic())
                has_work = self.engine.has_unfinished_requests()
                self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - any failure of the loop kills the engine
            logger.exception("engine loop died")
            self._die(e)

    def _execute(self, command: _Command) -> None:
        """Run one command; its exception goes to its caller, never into the loop."""
        try:
            result = command.fn()
        except Exception as e:  # noqa: BLE001
            if command.future is None:
                logger.exception("engine command failed")
            else:
                self._resolve(command, None, e)
            return
        if command.future is not None:
            self._resolve(command, result, None)

    @staticmethod
    def _resolve(command: _Command, result: Any, error: BaseException | None) -> None:
        future = command.future
        assert future is not None and command.loop is not None

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            command.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        if self.observer is not None:
            try:
                self.observer.on_outputs(outputs, now)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("observer failed")
        orphans: list[str] = []
        for output in outputs:
            with self._cond:
                stream = self._streams.get(output.request_id)
                if stream is not None and output.finished:
                    del self._streams[output.request_id]
            if stream is None:
                continue
            try:
                stream.loop.call_soon_threadsafe(stream.put, _snapshot(output))
            except RuntimeError:  # the consumer's loop is gone: nobody will read this request
                orphans.append(output.request_id)
        for request_id in orphans:
            with self._cond:
                self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _publish_stats(self) -> None:
        self._stats = self.engine.get_stats()
        if self.observer is not None:
            try:
                self.observer.on_stats(self._stats)
            except Exception:  # noqa: BLE001
                logger.exception("observer failed")

    def _die(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop died: {error!r}")
        dead.__cause__ = error
        with self._cond:
            self._dead_error = error
            streams = list(self._streams.values())
            self._streams.clear()
            commands = list(self._commands)
            self._commands.clear()
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.fail, dead)
            except RuntimeError:
                pass
        for command in commands:
            if command.future is not None:
                self._resolve(command, None, dead)
