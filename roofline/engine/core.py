"""The engine core: one ``LLMEngine`` and its step loop behind a message channel.

The OpenAI server runs the core in a child process (``spawn``, so CUDA is initialised only
there), as vLLM v1's EngineCore: the step loop never shares an interpreter lock with the HTTP
event loop. The API process sends commands (``AddRequest``, ``AddRequests`` (all the prompts of
one client request, admitted together or not at all), ``AbortRequests``, ``Shutdown``, in
:mod:`roofline.engine.core_messages`); the core answers with one ``CoreOutputs`` per loop
iteration: the verdicts on the adds it just took (sent before the step, so an HTTP answer never
waits for a step), then the step's outputs of every request that changed, as deltas (requests
are added with ``delta=True``: only the text, token ids and logprobs new since the request's
previous output; prompts are left out, the API process has them). Every request streams, also
those whose client waits for the whole answer: the per-step outputs time every token for the
server's metrics (the API process merges them). Every message carries the engine's stats.
Messages are dataclasses, pickled over a ``multiprocessing`` pipe.

If ``step()`` raises, the core reports ``CoreFailed`` and stops: the engine's state is
unknown after a failed step. A bad request only fails its own add. When the API process goes
away (the pipe reaches EOF) the core exits, so it never outlives the server.

:class:`ThreadCore` runs the same loop on a thread of the calling process, around an
engine built there (``roofline serve --engine-in-process``, and code that wraps an ``LLM``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Protocol

from roofline.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Command,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    Shutdown,
    portable,
)
from roofline.engine.heap import freeze_startup_heap

if TYPE_CHECKING:
    from roofline.engine.args import EngineArgs
    from roofline.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the loop
class _Channel(Protocol):
    def recv(self, block: bool) -> list[Command] | None:
        """Every waiting command (waits for one if ``block``); None once the client is gone."""

    def send(self, message: CoreOutputs | CoreFailed) -> None: ...


class EngineCore:
    """Runs ``engine.step()`` while requests are unfinished, taking commands between steps."""

    def __init__(self, engine: LLMEngine, channel: _Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.pack_s = 0.0
        """Seconds spent turning step outputs into messages."""
        self.send_s = 0.0
        """Seconds spent handing messages to the channel (a pipe blocks while it is full)."""
        self.add_times: list[float] | None = None
        """With a step trace: when each request was added (``time.perf_counter``)."""

    def run(self) -> None:
        """Serve until told to stop or the client goes away; a failing step is reported as
        :class:`CoreFailed` and re-raised. ``ROOFLINE_STEP_TRACE=path``: the engine's step
        trace (``LLMEngine.step_trace``) is written there as JSON when the loop ends."""
        trace_path = os.environ.get("ROOFLINE_STEP_TRACE")
        if trace_path:
            self.engine.step_trace = []
            self.add_times = []
        try:
            self._loop()
            self._log_timing()
            if trace_path:
                with open(trace_path, "w") as f:
                    json.dump({"steps": self.engine.step_trace, "adds": self.add_times}, f)
        except BaseException as e:
            logger.exception("engine core died")
            try:
                self.channel.send(CoreFailed(portable(e)))
            except Exception:  # noqa: BLE001 - the client may be gone too
                pass
            raise

    def _loop(self) -> None:
        engine = self.engine
        while True:
            commands = self.channel.recv(block=not engine.has_unfinished_requests())
            if commands is None:
                return
            added: list[tuple[str, BaseException | None]] = []
            for command in commands:
                if isinstance(command, AddRequest):
                    added.append((command.request_id, self._add(command)))
                elif isinstance(command, AddRequests):
                    added += self._add_all(command.requests)
                elif isinstance(command, AbortRequests):
                    engine.abort_request(command.request_ids)
                elif isinstance(command, Shutdown):
                    return
            if added:
                if self.add_times is not None:
                    self.add_times += [time.perf_counter()] * len(added)
                self.channel.send(CoreOutputs(engine.get_stats(), time.monotonic(), added))
            if engine.has_unfinished_requests():
                step_rows = engine.step_rows()  # the outputs in wire form (pack_outputs')
                t0 = time.perf_counter()
                message = CoreOutputs(engine.get_stats(), time.monotonic(), outputs=step_rows)
                t1 = time.perf_counter()
                self.channel.send(message)
                self.pack_s += t1 - t0
                self.send_s += time.perf_counter() - t1
            elif commands and not added:  # aborts only: publish the freed state
                self.channel.send(CoreOutputs(engine.get_stats(), time.monotonic()))

    def _log_timing(self) -> None:
        t = self.engine.step_timing
        if t.steps:
            ms = 1000.0 / t.steps
            logger.info(
                "engine core: %d steps, per step %.2f ms in step() (%.2f ms of it waiting for "
                "the device), %.2f ms packing outputs, %.2f ms sending them",
                t.steps,
                t.total_s * ms,
                t.wait_s * ms,
                self.pack_s * ms,
                self.send_s * ms,
            )

    def _add(self, command: AddRequest) -> BaseException | None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                command.priority,
                command.arrival_time,
                prompt_text=command.prompt_text,
                delta=True,
            )
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            return portable(e)
        return None

    def _add_all(self, commands: list[AddRequest]) -> list[tuple[str, BaseException | None]]:
        """Add every request or none: on a failure those already added are aborted and the
        failure is the verdict on all of them."""
        added: list[str] = []
        for command in commands:
            error = self._add(command)
            if error is not None:
                self.engine.abort_request(added)
                return [(c.request_id, error) for c in commands]
            added.append(command.request_id)
        return [(c.request_id, None) for c in commands]


def ready_message(engine: LLMEngine) -> CoreReady:
    return CoreReady(
        engine.model_name, engine.max_model_len, engine.model_config.vocab_size, os.getpid()
    )


# --------------------------------------------------------------------------- in a process
class _PipeChannel:
    def __init__(self, conn: Connection, idle_check: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.idle_check = idle_check
        """Called about once a second while the core waits for commands (it raises when the
        engine can no longer serve: a dead tensor-parallel worker)."""

    def recv(self, block: bool) -> list[Command] | None:
        commands: list[Command] = []
        try:
            if block:
                while self.idle_check is not None and not self.conn.poll(1.0):
                    self.idle_check()
                commands.append(self.conn.recv())
            while self.conn.poll():
                commands.append(self.conn.recv())
        except (EOFError, OSError):
            return None
        return commands

    def send(self, message: CoreOutputs | CoreFailed) -> None:
        self.conn.send(message)


def run_core_process(
    args: EngineArgs,
    conn: Connection,
    setup: Callable[[LLMEngine], None] | None,
    log_level: int,
) -> None:
    """The child process: build the engine, report :class:`CoreReady` (or
    :class:`CoreFailed`), then run the loop. ``setup(engine)`` runs first if given (tests
    inject faults with it; it must be picklable: a module-level function)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s"
    )
    from roofline.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(args)
        if setup is not None:
            setup(engine)
    except BaseException as e:
        logger.exception("the engine could not be built")
        conn.send(CoreFailed(portable(e)))
        raise SystemExit(1) from e
    freeze_startup_heap()  # the model and imports: out of the GC's full collections
    conn.send(ready_message(engine))
    try:
        idle_check = getattr(engine.runner, "check_health", None)  # tensor-parallel workers
        EngineCore(engine, _PipeChannel(conn, idle_check)).run()
    except BaseException:
        raise SystemExit(1) from None
    finally:
        engine.shutdown()  # tensor-parallel workers, if any


class CoreHandle(Protocol):
    """The API process's end of a running core."""

    ready: CoreReady

    def send(self, command: Command) -> None: ...

    def recv(self) -> CoreOutputs | CoreFailed:
        """The next message; raises ``EOFError`` once the core is gone."""

    def is_alive(self) -> bool: ...

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a core that is stopping to be gone."""

    def stop(self, timeout: float) -> None: ...

    def close(self) -> None: ...

    @property
    def exit_info(self) -> str: ...


class ProcessCore:
    """A core in a child process. Construction waits for :class:`CoreReady`; a core that
    fails to build raises its error here. (``spawn`` re-imports the parent's ``__main__``: a
    script that starts a core needs the ``if __name__ == "__main__":`` guard.)"""

    def __init__(self, args: EngineArgs, setup: Callable[[LLMEngine], None] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=run_core_process,
            args=(args, child, setup, logging.getLogger().getEffectiveLevel()),
            name="roofline-engine-core",
            daemon=True,  # terminated if the API process exits without stopping it
        )
        self.process.start()
        child.close()  # the core's end lives in the core only: its death is EOF here
        self._send_lock = threading.Lock()
        try:
            first = self.recv()
        except EOFError:
            self.stop(1.0)
            self.close()
            raise RuntimeError(
                f"the engine core exited during start-up ({self.exit_info})"
            ) from None
        if isinstance(first, CoreFailed):
            self.stop(5.0)
            self.close()
            raise first.error
        assert isinstance(first, CoreReady), first
        self.ready = first

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exit_info(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"

    def send(self, command: Command) -> None:
        with self._send_lock:  # aborts may come from any thread
            self.conn.send(command)

    def recv(self) -> CoreOutputs | CoreFailed | CoreReady:
        ready = wait([self.conn, self.process.sentinel])
        if self.conn in ready:
            return self.conn.recv()  # EOFError when the core's end is closed
        raise EOFError  # the process is gone and nothing is left to read

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def stop(self, timeout: float) -> None:
        """Ask the core to stop (a Shutdown command), then terminate, then kill it."""
        if self.process.is_alive():
            try:
                self.send(Shutdown())
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def close(self) -> None:
        """Close this end of the pipe (once nothing reads it any more)."""
        self.conn.close()


# --------------------------------------------------------------------------- on a thread
_EOF = object()


class _QueueChannel:
    def __init__(self, commands: queue.SimpleQueue, messages: queue.SimpleQueue) -> None:
        self.commands = commands
        self.messages = messages

    def recv(self, block: bool) -> list[Command] | None:
        out: list[Command] = []
        try:
            if block:
                out.append(self.commands.get())
            while True:
                out.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return None if any(c is _EOF for c in out) else out

    def send(self, message: CoreOutputs | CoreFailed) -> None:
        self.messages.put(message)


class ThreadCore:
    """A core on a thread of this process, around an engine built here."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ready = ready_message(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self.pid = os.getpid()
        core = EngineCore(engine, _QueueChannel(self._commands, self._messages))
        self._failed = False

        def run() -> None:
            try:
                core.run()
            except BaseException:  # noqa: BLE001 - reported as CoreFailed already
                self._failed = True
            finally:
                self._messages.put(_EOF)

        self.thread = threading.Thread(target=run, name="roofline-engine-core", daemon=True)
        self.thread.start()

    @property
    def exit_info(self) -> str:
        return "the step loop failed" if self._failed else "stopped"

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def recv(self) -> CoreOutputs | CoreFailed:
        message = self._messages.get()
        if message is _EOF:
            raise EOFError
        return message

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def stop(self, timeout: float) -> None:
        self._commands.put(_EOF)
        self.thread.join(timeout)

    def close(self) -> None:
        pass
