"""What completions and chat completions share: starting engine requests, following them until
they finish (aborting them when the client goes away), turning cumulative outputs into deltas,
and the SSE framing of a stream (``data: {...}`` lines closed by ``data: [DONE]``; a failure in
the middle of a stream is sent as one error event before ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from roofline.engine.async_engine import AsyncLLMEngine, RequestStream
from roofline.entrypoints.openai.errors import OpenAIError, from_exception
from roofline.entrypoints.openai.protocol import Usage
from roofline.outputs import Logprob, RequestOutput
from roofline.sampling_params import SamplingParams


@dataclass
class ServingState:
    """What every handler needs: the engine and the server's settings."""

    engine: AsyncLLMEngine
    served_model_name: str
    model_root: str | None = None
    allow_request_chat_template: bool = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                404,
                f"the model '{model}' does not exist; this server serves "
                f"'{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )


async def add_requests(
    state: ServingState,
    prompts: list[str | list[int]],
    params: SamplingParams,
    base_id: str,
    priority: int,
    param: str,
) -> list[RequestStream]:
    """Add one engine request per prompt; on any failure abort those already added and raise
    the matching :class:`OpenAIError`."""
    vocab = state.engine.vocab_size
    for prompt in prompts:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(
                    400,
                    f"token id {bad[0]} is out of the vocabulary [0, {vocab})",
                    param=param,
                    code="invalid_token_id",
                )
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise OpenAIError(
            400,
            f"stop token id {bad_stop[0]} is out of the vocabulary [0, {vocab})",
            param="stop_token_ids",
            code="invalid_token_id",
        )
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await state.engine.add_request(request_id, prompt, params, priority))
    except BaseException as e:
        for s in streams:
            state.engine.abort(s.request_id)
        if isinstance(e, Exception):
            raise from_exception(e, param=param) from e
        raise
    return streams


async def iterate(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt index, output)`` from all streams as they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def abort_unfinished(state: ServingState, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            state.engine.abort(s.request_id)


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(
    state: ServingState, raw: Request, streams: list[RequestStream]
) -> list[RequestOutput]:
    """Wait for every request's final output; abort them all if the client disconnects."""

    async def run() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, output in iterate(streams):
            finals[i] = output
        return [f for f in finals if f is not None]

    work = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise OpenAIError(499, "client disconnected", code="client_disconnected")
        finals = work.result()
    except Exception as e:
        if isinstance(e, OpenAIError):
            raise
        raise from_exception(e) from e
    finally:
        watcher.cancel()
        work.cancel()
        abort_unfinished(state, streams)
    for out in finals:
        if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
            raise OpenAIError(500, f"the request failed in the engine: {out.error}")
    return finals


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool
    """True for the choice's first chunk (chat sends the assistant role then)."""
    text_offset: int
    """Length of the choice's text before this delta."""


@dataclass
class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas (choice index = prompt * n + index)."""

    n: int
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    """choice index -> (characters sent, tokens sent)."""
    finished: set[int] = field(default_factory=set)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        out = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self.finished:
                continue
            first = index not in self.sent
            num_chars, num_tokens = self.sent.get(index, (0, 0))
            text = c.text[num_chars:]
            token_ids = c.token_ids[num_tokens:]
            if not text and not token_ids and not c.finish_reason and not first:
                continue
            logprobs = None if c.logprobs is None else c.logprobs[num_tokens:]
            self.sent[index] = (len(c.text), len(c.token_ids))
            if c.finish_reason:
                self.finished.add(index)
            out.append(
                Delta(
                    index,
                    text,
                    token_ids,
                    logprobs,
                    c.finish_reason,
                    c.stop_reason,
                    first,
                    num_chars,
                )
            )
        return out


async def token_strings(state: ServingState, deltas: list[Delta]) -> dict[int, str]:
    """Text of every token mentioned in the deltas' logprobs that has no ``decoded_token``
    (decoded on the engine thread, where the tokenizer lives)."""
    missing = {
        tid
        for d in deltas
        if d.logprobs
        for step in d.logprobs
        for tid, lp in step.items()
        if lp.decoded_token is None
    }
    if not missing:
        return {}
    ids = sorted(missing)

    def decode(engine: Any) -> list[str]:
        tok = engine.tokenizer
        return [f"<{i}>" if tok is None else tok.decode([i]) for i in ids]

    return dict(zip(ids, await state.engine.run_in_engine(decode), strict=True))


def ranked(
    step: dict[int, Logprob], sampled: int, k: int, names: dict[int, str]
) -> tuple[tuple[str, float | None], list[tuple[str, float]]]:
    """(sampled token's (text, logprob), the k most likely as (text, logprob)); the logprob is
    None if the engine did not report the sampled token."""

    def name(tid: int, lp: Logprob) -> str:
        return lp.decoded_token if lp.decoded_token is not None else names.get(tid, "")

    sampled_lp = step.get(sampled)
    chosen = (name(sampled, sampled_lp), sampled_lp.logprob) if sampled_lp else ("", None)
    top = sorted(step.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
    return chosen, [(name(t, lp), lp.logprob) for t, lp in top]


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def sse_stream(
    state: ServingState,
    streams: list[RequestStream],
    render: Callable[[int, RequestOutput], Awaitable[list[dict[str, Any]]]],
    final: Callable[[list[RequestOutput]], list[dict[str, Any]]],
) -> AsyncIterator[str]:
    """The SSE body: ``render`` turns each output into chunks, ``final`` adds closing ones
    (the usage chunk) once every request finished. Aborts unfinished requests if the client
    goes away (Starlette cancels this generator then)."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, output in iterate(streams):
            if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
                raise OpenAIError(500, f"the request failed in the engine: {output.error}")
            for chunk in await render(i, output):
                yield sse_event(chunk)
            if output.finished:
                finals[i] = output
        for chunk in final([finals[i] for i in sorted(finals)]):
            yield sse_event(chunk)
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        err = from_exception(e)
        yield sse_event(err.to_dict())
    finally:
        abort_unfinished(state, streams)
    yield "data: [DONE]\n\n"
