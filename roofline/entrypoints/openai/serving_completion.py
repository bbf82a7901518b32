"""``POST /v1/completions``: prompts (text, token ids, or a batch of either) to completions,
streamed as SSE or answered at once. Choice ``i * n + j`` is the ``j``-th completion of the
``i``-th prompt; ``logprobs`` follows the legacy completions shape (tokens, token_logprobs,
top_logprobs, text_offset).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from roofline.entrypoints.openai.errors import from_exception
from roofline.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from roofline.entrypoints.openai.serving_base import (
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


def _logprobs(delta: Delta, k: int, names: dict[int, str]) -> CompletionLogprobs | None:
    if delta.logprobs is None:
        return None
    out = CompletionLogprobs()
    offset = delta.text_offset
    for tid, step in zip(delta.token_ids, delta.logprobs, strict=False):
        (text, logprob), top = ranked(step, tid, k, names)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(dict(top) if k > 0 else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def create_completion(state: ServingState, body: CompletionRequest, raw: Request) -> Any:
    state.check_model(body.model)
    try:
        params = body.to_sampling_params()
    except ValueError as e:
        raise from_exception(e) from e
    prompts = body.prompts()
    request_id = random_id("cmpl")
    streams = await add_requests(state, prompts, params, request_id, body.priority, "prompt")
    created = int(time.time())
    k = params.logprobs or 0

    if not body.stream:
        finals = await collect(state, raw, streams)
        tracker = DeltaTracker(params.n)
        choices = []
        for i, out in enumerate(finals):
            deltas = tracker.deltas(i, out)
            names = await token_strings(state, deltas)
            for d in deltas:
                choices.append(
                    CompletionChoice(
                        index=d.index,
                        text=d.text,
                        logprobs=_logprobs(d, k, names),
                        finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason,
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

    tracker = DeltaTracker(params.n)
    include_usage = body.include_usage

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = None
        return c

    async def render(i: int, output: RequestOutput) -> list[dict[str, Any]]:
        deltas = tracker.deltas(i, output)
        names = await token_strings(state, deltas)
        chunks = []
        for d in deltas:
            lp = _logprobs(d, k, names)
            chunks.append(
                chunk(
                    [
                        {
                            "index": d.index,
                            "text": d.text,
                            "logprobs": None if lp is None else lp.model_dump(),
                            "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason,
                        }
                    ]
                )
            )
        return chunks

    def final(finals: list[RequestOutput]) -> list[dict[str, Any]]:
        if not include_usage:
            return []
        c = chunk([])
        c["usage"] = usage_of(finals).model_dump()
        return [c]

    return StreamingResponse(
        sse_stream(state, streams, render, final),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
