"""``POST /v1/completions``: prompts (text, token ids, or a batch of either) to completions,
streamed as SSE or answered at once. Choice ``i * n + j`` is the ``j``-th completion of the
``i``-th prompt; ``logprobs`` follows the legacy completions shape (tokens, token_logprobs,
top_logprobs, text_offset). ``echo`` and ``prompt_logprobs`` put the prompt and its
logprobs in front of each choice (``echo.py``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from roofline.entrypoints.openai.echo import echo_logprobs, prompt_logprobs_json, prompt_text
from roofline.entrypoints.openai.errors import from_exception
from roofline.entrypoints.openai.grammar_check import check_constraint
from roofline.entrypoints.openai.guards import ClientWatch, check_text
from roofline.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from roofline.entrypoints.openai.serving_base import (
    ChunkFormat,
    Delta,
    DeltaTracker,
    ServingState,
    add_requests,
    collect,
    ranked,
    sse_stream,
    token_strings,
    usage_of,
)
from roofline.outputs import RequestOutput


def _logprobs(delta: Delta, k: int, names: dict[int, str]) -> dict[str, list] | None:
    if delta.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = delta.text_offset
    for tid, step in zip(delta.token_ids, delta.logprobs, strict=False):
        (text, logprob), top = ranked(step, tid, k, names)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(dict(top) if k > 0 else None)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


async def create_completion(state: ServingState, body: CompletionRequest, raw: Request) -> Any:
    check_text(body)
    state.check_request(body.model)
    watch = ClientWatch(raw)
    try:
        return await _create_completion(state, body, watch)
    finally:
        watch.stop()


async def _create_completion(
    state: ServingState, body: CompletionRequest, watch: ClientWatch
) -> Any:
    try:
        params = body.to_sampling_params()
    except ValueError as e:
        raise from_exception(e) from e
    await check_constraint(state, params.structured_outputs)
    prompts = body.prompts()
    request_id = random_id("cmpl")
    streams = await watch.guard(
        add_requests(state, prompts, params, request_id, body.priority, "prompt", body.stream)
    )
    created = int(time.time())
    k = params.logprobs or 0
    tracker = DeltaTracker(params.n)

    if not body.stream:
        finals = await collect(state, watch, streams)
        choices = []
        for i, out in enumerate(finals):
            deltas = tracker.deltas(i, out)
            names = token_strings(state, deltas)
            for d in deltas:
                text, logprobs = d.text, _logprobs(d, k, names)
                if body.echo:
                    text = prompt_text(state, out) + text
                    if body.logprobs is not None:
                        logprobs = echo_logprobs(state, out, k, logprobs)
                choices.append(
                    CompletionChoice(
                        index=d.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(out)
                        if body.prompt_logprobs is not None
                        else None,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=state.served_model_name,
            choices=choices,
            usage=usage_of(finals),
        )

    fmt = ChunkFormat(
        request_id,
        "text_completion",
        created,
        state.served_model_name,
        tracker,
        sum(len(s.prompt_token_ids) for s in streams),
        body.include_usage,
        body.continuous_usage,
    )

    def render(i: int, output: RequestOutput) -> str:
        deltas = tracker.deltas(i, output)
        names = token_strings(state, deltas)
        events = []
        for d in deltas:
            choice = {
                "index": d.index,
                "text": d.text,
                "logprobs": _logprobs(d, k, names),
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            if d.first and body.echo:  # the prompt goes in front of the first chunk
                choice["text"] = prompt_text(state, output) + d.text
                if body.logprobs is not None:
                    choice["logprobs"] = echo_logprobs(state, output, k, choice["logprobs"])
            if d.first and body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(output)
            events.append(fmt.event([choice]))
        return "".join(events)

    return StreamingResponse(
        sse_stream(state, streams, render, fmt.usage_event),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
