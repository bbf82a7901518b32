"""What the server checks on every generation request before it costs anything, and the watch
on the client while it does.

* :func:`check_text` walks a parsed request once and refuses (400, the field named) any string
  that is not valid Unicode: JSON lets a client send a lone UTF-16 surrogate (``"\\ud800"``,
  what ``JSON.stringify`` makes of half an emoji), which no tokenizer, template or response
  encoder can take. It runs first, so no later error message can echo such a string.
* :func:`check_fan_out` bounds the sequences one request may start (prompts x ``n``; the
  operator sets the limit, ``--max-seqs-per-request``).
* :func:`refuse_legacy_functions` refuses the pre-tools ``functions`` / ``function_call``
  fields instead of ignoring them.
* :class:`ClientWatch` listens for the client's disconnect from the moment a handler starts, so
  a client that leaves during template rendering or admission gets nothing admitted (or what
  was admitted aborted at once) and one that leaves while its answer is made aborts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from roofline.entrypoints.openai.errors import OpenAIError

T = TypeVar("T")
_SCALARS = frozenset({int, float, bool, type(None)})


def _bad_unicode(text: str) -> int | None:
    """Index of the first code point UTF-8 cannot encode (a lone surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _where(path: list[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def check_text(body: BaseModel) -> None:
    """Refuse a request holding a string (a value or an object key, at any depth, in any
    field) that is not valid Unicode. Linear in the size of the request (lists of numbers,
    such as token-id prompts, are passed over in one C-level pass)."""
    stack: list[tuple[list[str | int], Any]] = [
        ([name], getattr(body, name)) for name in type(body).model_fields
    ]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            index = _bad_unicode(value)
            if index is not None:
                raise OpenAIError(
                    400,
                    f"invalid value for '{_where(path)}': not valid Unicode (a lone UTF-16 "
                    f"surrogate U+{ord(value[index]):04X} at character {index}); send UTF-8 "
                    "text, or both halves of a surrogate pair",
                    param=str(path[0]),
                    code="invalid_unicode",
                )
        elif isinstance(value, BaseModel):
            stack += [([*path, n], getattr(value, n)) for n in type(value).model_fields]
        elif isinstance(value, (list, tuple)):
            if set(map(type, value)) <= _SCALARS:  # token ids: one pass in C, no text inside
                continue
            stack += [([*path, i], v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append(([*path, "<key>"], k))
                stack.append(([*path, str(k)], v))


def refuse_legacy_functions(body: Any) -> None:
    """The deprecated ``functions`` / ``function_call`` fields: refused, never ignored."""
    for name in ("functions", "function_call"):
        if getattr(body, name, None) is not None:
            raise OpenAIError(
                400,
                f"'{name}' (the deprecated function-calling API) is not supported; "
                "send 'tools' / 'tool_choice'",
                param=name,
                code="unsupported_parameter",
            )


def check_fan_out(num_prompts: int, n: int, limit: int) -> None:
    """Refuse a request that would start more than ``limit`` sequences."""
    if num_prompts * n > limit:
        raise OpenAIError(
            400,
            f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
            f"sequences; this server allows at most {limit} per request",
            param="n",
            code="too_many_sequences",
        )


def client_gone() -> OpenAIError:
    return OpenAIError(499, "client disconnected", code="client_disconnected")


class ClientWatch:
    """Listens for the client's disconnect while a handler works (start it before any work;
    ``stop`` it before handing the connection to a streaming response, which watches on its
    own)."""

    def __init__(self, raw: Request) -> None:
        self._task = asyncio.ensure_future(self._wait(raw))

    @staticmethod
    async def _wait(raw: Request) -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    @property
    def gone(self) -> bool:
        return self._task.done() and not self._task.cancelled()

    async def guard(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` unless or until the client leaves: then ``work`` is cancelled (a
        cancelled admission aborts what it added) and a 499 is raised."""
        await asyncio.sleep(0)  # let the watch see a disconnect that is already known
        if self.gone:
            work.close()
            raise client_gone()
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - it was cancelled: its outcome is moot
                pass
            raise client_gone()
        return task.result()

    def stop(self) -> None:
        self._task.cancel()
