"""The asyncio face of the engine core, used by the OpenAI server.

:class:`AsyncLLMEngine` lives in the API process. It starts an engine core
(:mod:`roofline.engine.core`: by default in its own process, optionally on a thread), keeps the
tokenizer for prompts and chat templates, and gives every request a :class:`RequestStream`.
Commands go to the core as messages; one reader thread takes the core's messages (one per
step, holding every changed request's delta output) and hands each to the event loop with a
single ``call_soon_threadsafe``. Streams merge deltas a slow consumer has not read yet, so no
text is ever lost and a consumer that falls behind gets one bigger delta.

Invalid requests fail in ``add_request`` (``ValueError``, ``QueueFullError``, ... raised by the
core's ``LLMEngine.add_request`` come back as themselves) and never touch the loop. If the core
dies (a step raised, or its process exited), every pending request gets
:class:`EngineDeadError`, health checks fail and new requests are refused.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from roofline.engine.core import CoreHandle, ProcessCore, ThreadCore
from roofline.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    CoreOutputs,
    unpack_outputs,
)
from roofline.engine.prompt import tokenize_prompt
from roofline.engine.request_stream import RequestStream
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roofline.engine.args import EngineArgs
    from roofline.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped after an error (or was shut down); nothing more can be served."""


class EngineObserver(Protocol):
    """Receives what the core reports (the server's Prometheus metrics implement it).

    Called on the reader thread (``on_aborted`` on the aborting thread); must be quick and
    never raise. Outputs are deltas."""

    def on_added(self, request_id: str, arrival_time: float) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_id: str, now: float) -> None: ...

    def on_stats(self, stats: Any) -> None: ...


def _deliver(
    acks: list[tuple[RequestStream, BaseException | None]],
    outputs: list[tuple[RequestStream, RequestOutput]],
) -> None:
    """On the event loop: settle adds, then hand out outputs (in the core's order)."""
    for stream, error in acks:
        if stream.added.done():
            continue
        if error is None:
            stream.added.set_result(None)
        else:
            stream.added.set_exception(error)
    for stream, output in outputs:
        stream.put(output)


def _shutdown_at_exit(ref: weakref.ref[AsyncLLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown(5.0)


def _fail_all(streams: list[RequestStream], error: BaseException) -> None:
    for stream in streams:
        stream.fail(error)


class AsyncLLMEngine:
    """Serves an engine core to asyncio code. Build it with :meth:`from_engine_args` (a core
    process, or a thread with ``in_process=True``) or :meth:`from_engine` (a thread around an
    engine built here)."""

    def __init__(
        self, core: CoreHandle, tokenizer: Any, observer: EngineObserver | None = None
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.observer = observer
        ready = core.ready
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._dead_error: BaseException | None = None
        self._closed = False
        self._stats: Any = None
        self._reader = threading.Thread(target=self._read, name="roofline-core-reader", daemon=True)
        self._reader.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        observer: EngineObserver | None = None,
        *,
        in_process: bool = False,
        core_setup: Callable[[LLMEngine], None] | None = None,
    ) -> AsyncLLMEngine:
        """Start a core for ``args``: a child process (default), or a thread of this process
        with ``in_process``. ``core_setup(engine)`` runs in the core once the engine is built
        (a module-level function for a process)."""
        if in_process:
            from roofline.engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(args)
            if core_setup is not None:
                core_setup(engine)
            return cls.from_engine(engine, observer)
        from roofline.models.weights import load_tokenizer, resolve_model

        core = ProcessCore(args, core_setup)
        try:  # after the core is up: a GGUF tokenizer is then read from its cache
            tokenizer = load_tokenizer(resolve_model(args.model))
        except BaseException:
            core.stop(5.0)
            core.close()
            raise
        return cls(core, tokenizer, observer)

    @classmethod
    def from_engine(
        cls, engine: LLMEngine, observer: EngineObserver | None = None
    ) -> AsyncLLMEngine:
        """Serve an engine built in this process from a thread (the engine is the thread's
        alone from now on)."""
        return cls(ThreadCore(engine), engine.tokenizer, observer)

    # ----------------------------------------------------------------- read-only facts
    @property
    def core_pid(self) -> int | None:
        """The core's process id (this process's own for a thread core)."""
        return getattr(self.core, "pid", None)

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or not self.core.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        if self._dead_error is None and not self.core.is_alive():
            return EngineDeadError(f"the engine core is gone ({self.core.exit_info})")
        return self._dead_error

    def get_stats(self) -> Any:
        """The engine's ``EngineStats`` as of the core's latest message."""
        return self._stats

    @property
    def num_active_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    # ----------------------------------------------------------------- tokenizer
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def decode_token(self, token_id: int) -> str:
        return f"<{token_id}>" if self.tokenizer is None else self.tokenizer.decode([token_id])

    # ----------------------------------------------------------------- event-loop API
    def _check_alive(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"the engine loop is dead: {self.dead_error!r}")

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = True,
    ) -> RequestStream:
        """Queue a request; raises what ``LLMEngine.add_request`` raises (``ValueError`` for
        bad input, ``QueueFullError``) or :class:`EngineDeadError`. With ``stream=False`` the
        stream yields one output, the final one, with everything."""
        return (await self.add_requests([request_id], [prompt], params, priority, stream))[0]

    async def add_requests(
        self,
        request_ids: list[str],
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = True,
    ) -> list[RequestStream]:
        """Queue the prompts of one client request in one message to the core: every one is
        admitted or none (the first failure is raised; nothing is sent if a prompt fails to
        tokenize). Cancelled while waiting for the verdict, it aborts them all."""
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request ids must be distinct")
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        outs = [
            RequestStream(rid, loop, text, token_ids, arrival, final_only=not stream)
            for rid, (text, token_ids) in zip(request_ids, tokenized, strict=True)
        ]
        with self._lock:
            self._check_alive()
            for rid in request_ids:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in use")
            for out in outs:
                self._streams[out.request_id] = out
        adds = [
            AddRequest(o.request_id, o.prompt_token_ids, params, priority, arrival, o.prompt)
            for o in outs
        ]
        try:
            self.core.send(adds[0] if len(adds) == 1 else AddRequests(adds))
            await asyncio.wait([o.added for o in outs])
        except asyncio.CancelledError:
            self.abort(request_ids)  # the core may have taken them: undo
            raise
        except BaseException as e:
            self._forget(request_ids)
            if isinstance(e, OSError):  # the pipe broke: the core is gone
                raise EngineDeadError(f"the engine core is gone: {e!r}") from e
            raise
        errors = [o.added.exception() for o in outs]  # all retrieved: no asyncio warnings
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            self.abort(request_ids)  # settled together; a no-op unless the engine died between
            raise first
        return outs

    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._streams.pop(rid, None)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's delta outputs until it finishes; aborts it if the consumer stops
        early."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests (idempotent; callable from any thread, never blocks on a step; one
        message for all of them)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        with self._lock:
            streams = [s for s in (self._streams.pop(rid, None) for rid in ids) if s is not None]
        if not streams or self.is_dead:
            return
        if self.observer is not None:
            now = time.monotonic()
            for stream in streams:
                if stream.accepted:
                    self.observer.on_aborted(stream.request_id, now)
        try:
            self.core.send(AbortRequests([s.request_id for s in streams]))
        except OSError:  # the core is gone; the reader reports it
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (its process is terminated if it does not stop in ``timeout``) and
        fail whatever is still pending."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.core.stop(timeout)
        self._reader.join(timeout)
        self.core.close()
        self._die(EngineDeadError("the engine was shut down"))

    # ----------------------------------------------------------------- reader thread
    def _read(self) -> None:
        try:
            while True:
                message = self.core.recv()
                if isinstance(message, CoreOutputs):
                    self._dispatch(message)
                elif isinstance(message, CoreFailed):
                    self._die(message.error)
                    return
        except (EOFError, OSError):
            if self._closed:
                self._die(EngineDeadError("the engine was shut down"))
                return
            self.core.join(2.0)  # reap it, for its exit code
            logger.error("the engine core is gone (%s)", self.core.exit_info)
            self._die(EngineDeadError(f"the engine core is gone ({self.core.exit_info})"))
        except BaseException as e:  # noqa: BLE001 - a bug here must not hang every request
            logger.exception("the core reader failed")
            self._die(e)

    def _dispatch(self, message: CoreOutputs) -> None:
        observer = self.observer
        outputs = unpack_outputs(message.outputs)
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        with self._lock:
            self._stats = message.stats
            for request_id, error in message.added:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if error is None:
                    stream.accepted = True
                    if observer is not None:
                        observer.on_added(request_id, stream.arrival_time)
                else:
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, ([], []))[0].append((stream, error))
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                by_loop.setdefault(stream.loop, ([], []))[1].append((stream, output))
        if observer is not None:
            try:
                observer.on_stats(message.stats)
                if outputs:
                    observer.on_outputs(outputs, message.now)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                logger.exception("observer failed")
        for loop, (acks, outputs) in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, acks, outputs)
            except RuntimeError:  # the consumer's loop is closed: nobody reads these
                for stream, _ in outputs:
                    self.abort(stream.request_id)

    def _die(self, error: BaseException) -> None:
        if isinstance(error, EngineDeadError):
            dead: BaseException = error
        else:
            dead = EngineDeadError(f"the engine loop died: {error!r}")
            dead.__cause__ = error
        with self._lock:
            if self._dead_error is None:
                self._dead_error = error
            streams = list(self._streams.values())
            self._streams.clear()
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}
        for stream in streams:
            by_loop.setdefault(stream.loop, []).append(stream)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fail_all, group, dead)
            except RuntimeError:
                pass
