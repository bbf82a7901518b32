"""What completions and chat completions share: starting engine requests, following them until
they finish (aborting them when the client goes away), numbering the choices of delta outputs,
and the SSE framing of a stream (``data: {...}`` lines closed by ``data: [DONE]``; a failure in
the middle of a stream is sent as one error event before ``[DONE]``).

The streaming path is the per-token hot path of the server: each engine step gives each request
one (merged) delta output, which becomes at most one event per choice, built as plain dicts and
``json.dumps`` (no pydantic model per chunk). Non-streaming requests are added with
``stream=False``: the engine sends them once, finished.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from roofline.engine.async_engine import AsyncLLMEngine, RequestStream
from roofline.entrypoints.openai import DEFAULT_MAX_SEQS_PER_REQUEST
from roofline.entrypoints.openai.errors import OpenAIError, from_exception
from roofline.entrypoints.openai.guards import ClientWatch, check_fan_out
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
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    template_renderer: Any = None
    """The ``TemplateRenderer`` of request-supplied chat templates (when allowed)."""
    tool_call_parser: str = "auto"
    """``--tool-call-parser``: the tool-call format to read (auto: from the chat template)."""
    reasoning_parser: str | None = None
    """``--reasoning-parser``: split ``<think>`` reasoning from the content (None: off)."""
    grammar_checker: Any = None
    structured_outputs_backend: str = "auto"
    """The engine's grammar library: the API process checks constraints with the same one."""
    """The API process's grammar compiler (:class:`GrammarChecker`), built on first use."""

    def check_request(self, model: str | None) -> None:
        """Refuse a generation request once the engine is dead (503, before any other work), or
        one for another model (404)."""
        if self.engine.is_dead:
            raise OpenAIError(
                503, f"the engine loop is dead: {self.engine.dead_error!r}", code="engine_dead"
            )
        self.check_model(model)

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
    stream: bool,
) -> list[RequestStream]:
    """Add one engine request per prompt, all in one message (``stream=False``: the engine
    reports each once, when it has finished); all are admitted or none, and a failure is
    raised as the matching :class:`OpenAIError`."""
    check_fan_out(len(prompts), params.n, state.max_seqs_per_request)
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
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    try:
        return await state.engine.add_requests(ids, prompts, params, priority, stream)
    except Exception as e:
        raise from_exception(e, param=param) from e


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
    unfinished = [s.request_id for s in streams if not s.finished]
    if unfinished:
        state.engine.abort(unfinished)


async def collect(
    state: ServingState, watch: ClientWatch, streams: list[RequestStream]
) -> list[RequestOutput]:
    """Wait for every request's final output; abort them all if the client disconnects."""

    async def run() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, output in iterate(streams):
            finals[i] = output
        return [f for f in finals if f is not None]

    try:
        finals = await watch.guard(run())
    except Exception as e:
        if isinstance(e, OpenAIError):
            raise
        raise from_exception(e) from e
    finally:
        abort_unfinished(state, streams)
    for out in finals:
        if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
            raise OpenAIError(500, f"the request failed in the engine: {out.error}")
    return finals


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """Usage of complete (not delta) outputs."""
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
    """Numbers the choices of delta outputs (choice index = prompt index * n + completion
    index) and counts, per choice, what was already sent."""

    n: int
    chars: dict[int, int] = field(default_factory=dict)
    """choice index -> characters sent."""
    tokens: dict[int, int] = field(default_factory=dict)
    """choice index -> tokens sent."""
    finished: set[int] = field(default_factory=set)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        out = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self.finished:
                continue
            first = index not in self.chars
            if not c.text and not c.token_ids and not c.finish_reason and not first:
                continue
            num_chars = self.chars.get(index, 0)
            self.chars[index] = num_chars + len(c.text)
            self.tokens[index] = self.tokens.get(index, 0) + len(c.token_ids)
            if c.finish_reason:
                self.finished.add(index)
            out.append(
                Delta(
                    index,
                    c.text,
                    c.token_ids,
                    c.logprobs,
                    c.finish_reason,
                    c.stop_reason,
                    first,
                    num_chars,
                )
            )
        return out

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        """Usage so far, as a plain dict."""
        completion = sum(self.tokens.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }


def token_strings(state: ServingState, deltas: list[Delta]) -> dict[int, str]:
    """Text of every token mentioned in the deltas' logprobs that has no ``decoded_token``
    (only a model without a tokenizer leaves it out: those read ``<id>``)."""
    missing = {
        tid
        for d in deltas
        if d.logprobs
        for step in d.logprobs
        for tid, lp in step.items()
        if lp.decoded_token is None
    }
    return {tid: state.engine.decode_token(tid) for tid in missing}


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
    return f"data: {_dumps(payload)}\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class ChunkFormat:
    """The envelope of one streamed answer's chunks, serialized once: an event is the envelope's
    text around the ``json.dumps`` of its choices. With ``include_usage`` every chunk has a
    ``usage`` field, null (OpenAI) or, with ``continuous_usage`` (vLLM's
    ``continuous_usage_stats``), the usage so far; the last chunk holds the total."""

    def __init__(
        self,
        request_id: str,
        object: str,
        created: int,
        model: str,
        tracker: DeltaTracker,
        prompt_tokens: int,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        envelope = {"id": request_id, "object": object, "created": created, "model": model}
        self._head = f'data: {_dumps(envelope)[:-1]}, "choices": '
        self.tracker = tracker
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage

    def event(self, choices: list[dict[str, Any]]) -> str:
        if not self.include_usage:
            return f"{self._head}{_dumps(choices)}}}\n\n"
        usage = _dumps(self.tracker.usage(self.prompt_tokens)) if self.continuous_usage else "null"
        return f'{self._head}{_dumps(choices)}, "usage": {usage}}}\n\n'

    def usage_event(self) -> str:
        """The closing usage chunk (empty when usage was not asked for)."""
        if not self.include_usage:
            return ""
        usage = _dumps(self.tracker.usage(self.prompt_tokens))
        return f'{self._head}[], "usage": {usage}}}\n\n'


async def sse_stream(
    state: ServingState,
    streams: list[RequestStream],
    render: Callable[[int, RequestOutput], str],
    final: Callable[[], str],
) -> AsyncIterator[str]:
    """The SSE body: ``render`` turns each (merged) delta output into its events, at most one
    per choice; ``final`` adds closing ones (the usage chunk) once every request finished.
    Aborts unfinished requests if the client goes away (Starlette cancels this generator)."""
    try:
        async for i, output in iterate(streams):
            if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
                raise OpenAIError(500, f"the request failed in the engine: {output.error}")
            events = render(i, output)
            if events:
                yield events
        events = final()
        if events:
            yield events
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        err = from_exception(e)
        yield sse_event(err.to_dict())
    finally:
        abort_unfinished(state, streams)
    yield "data: [DONE]\n\n"
