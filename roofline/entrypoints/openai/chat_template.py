"""Rendering of request-supplied chat templates (``--trust-request-chat-template``) under a time
and an output-size bound.

A Jinja template is a program: a sandbox stops it from reaching Python internals, but not from
looping for hours (nested ``range`` loops), raising any exception, or building a huge string in
one C call. So templates sent by clients are rendered in worker processes
(:mod:`.template_worker`: jinja2's immutable sandbox, an address-space limit, an output limit in
characters), at most ``max_workers`` at a time. A render that is not done in ``timeout_s``
seconds, or whose client goes away, has its worker killed (nothing keeps burning a core), and a
fresh one is started for the next render; idle workers are kept for reuse. Every failure is a
:class:`TemplateRenderError`, which the chat handler answers with a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("template_worker.py")

RENDER_TIMEOUT_S = 2.0
"""Longest a request's template may render."""
MAX_RENDER_CHARS = 1 << 20
"""Longest rendered prompt, in characters (the context length bounds it in tokens later)."""
WORKER_MEMORY_BYTES = 1 << 30
"""Address-space limit of a render worker."""


class TemplateRenderError(Exception):
    """The template could not be rendered (its error, a time-out, a size limit)."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def render(self, payload: bytes, timeout_s: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(payload)
        await self.proc.stdin.drain()
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        except TimeoutError:
            raise TemplateRenderError(
                f"the chat template did not render within {timeout_s:g} s"
            ) from None
        if not line:
            raise TemplateRenderError("the chat template's rendering failed (out of memory?)")
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateRenderError(reply["error"])
        return reply["text"]

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class TemplateRenderer:
    """A small pool of render workers (started on first use, on the server's event loop)."""

    def __init__(
        self,
        max_workers: int = 2,
        timeout_s: float = RENDER_TIMEOUT_S,
        max_chars: int = MAX_RENDER_CHARS,
        memory_bytes: int = WORKER_MEMORY_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.memory_bytes = memory_bytes
        self._max_workers = max_workers
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self.num_started = 0
        """Workers started so far (a killed one is replaced)."""

    async def _start(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(WORKER),
            str(self.max_chars),
            str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=8 * self.max_chars + 65536,  # one reply line: the text, JSON-escaped
        )
        self.num_started += 1
        return _Worker(proc)

    async def render(self, template: str, context: dict[str, Any]) -> str:
        """The rendered text; raises :class:`TemplateRenderError`."""
        payload = json.dumps({"template": template, "context": context}).encode() + b"\n"
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            self._busy.add(worker)
            reusable = False
            try:
                text = await worker.render(payload, self.timeout_s)
                reusable = True
                return text
            except TemplateRenderError as e:
                reusable = worker.proc.returncode is None and "did not render" not in str(e)
                raise
            finally:
                self._busy.discard(worker)
                if reusable:
                    self._idle.append(worker)
                else:  # timed out, died, or its client left mid-render
                    worker.kill()
                    with contextlib.suppress(Exception):
                        await asyncio.shield(worker.proc.wait())

    async def close(self) -> None:
        """Stop every worker (the server's shutdown)."""
        workers = [*self._idle, *self._busy]
        self._idle.clear()
        for worker in workers:
            worker.kill()
        for worker in workers:
            with contextlib.suppress(Exception):
                await worker.proc.wait()
