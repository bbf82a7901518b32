"""The API process's side of streaming, without an engine: a request stream merges the deltas
its consumer has not read yet (text, token ids and logprobs concatenate per completion, the
rest is the newest), wakes a ``stream=False`` consumer only once, finished, and hands out what
it holds before an error; the wire form of delta outputs keeps every field."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from roofline.engine.core_messages import pack_outputs, unpack_outputs
from roofline.engine.request_stream import RequestStream
from roofline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def delta(tokens: dict[int, list[int]], finished: bool = False) -> RequestOutput:
    """A delta output: completion index -> its new token ids (text: one letter per token)."""
    outs = [
        CompletionOutput(
            index=i,
            text="".join(chr(97 + t) for t in ids),
            token_ids=list(ids),
            cumulative_logprob=-float(sum(ids)),
            logprobs=[{t: Logprob(-1.0, 1, chr(97 + t))} for t in ids],
            finish_reason="length" if finished else None,
        )
        for i, ids in tokens.items()
    ]
    return RequestOutput("r", None, [], outs, finished=finished)


def test_unread_deltas_merge_without_losing_anything() -> None:
    async def scenario() -> list[RequestOutput]:
        stream = RequestStream("r", asyncio.get_running_loop(), "p", [1, 2], 0.0)
        stream.put(delta({0: [0], 1: []}))
        first = await stream.__anext__()  # read at once: just the first delta
        for d in (delta({0: [1], 1: [2]}), delta({0: [3, 4], 1: []}), delta({1: [5]}, True)):
            stream.put(d)
        return [first] + [o async for o in stream]

    first, merged = asyncio.run(scenario())
    assert (first.prompt, first.prompt_token_ids, first.outputs[0].token_ids) == ("p", [1, 2], [0])
    a, b = merged.outputs
    assert (a.token_ids, a.text, [list(lp) for lp in a.logprobs]) == (
        [1, 3, 4],
        "bde",
        [[1], [3], [4]],
    )
    assert (b.token_ids, b.text, b.cumulative_logprob) == ([2, 5], "cf", -5.0)
    assert merged.finished and b.finish_reason == "length" and a.finish_reason is None


def test_final_only_stream_wakes_once_and_errors_after_data() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        whole = RequestStream("r", loop, None, [1], 0.0, final_only=True)
        whole.put(delta({0: [1]}))
        waiter = asyncio.ensure_future(whole.__anext__())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # not finished yet: nothing to hand out
        whole.put(delta({0: [2]}, finished=True))
        out = await waiter
        assert out.finished and out.outputs[0].token_ids == [1, 2]
        assert [o async for o in whole] == []

        failing = RequestStream("s", loop, None, [1], 0.0)
        failing.put(delta({0: [7]}))
        failing.fail(RuntimeError("core died"))
        assert (await failing.__anext__()).outputs[0].token_ids == [7]
        with pytest.raises(RuntimeError, match="core died"):
            await failing.__anext__()

    asyncio.run(scenario())


def test_wire_form_round_trips_every_field() -> None:
    out = RequestOutput(
        "r",
        None,
        [],
        [
            CompletionOutput(1, "ab", [3, 4], -1.5, [{3: Logprob(-0.5, 1, "a")}], "stop", "x"),
            CompletionOutput(0, "", [], None, None, None, None),
        ],
        finished=True,
        metrics=RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0, 6, 7),
        num_cached_tokens=6,
        error="boom",
    )
    # A new field needs packing; CompletionOutput's last two (tool_calls, content) are set by
    # LLM.chat after generation, never by the engine core, so they do not travel.
    for cls in (RequestOutput, CompletionOutput, RequestMetrics):
        assert len(dataclasses.fields(cls)) == {RequestOutput: 9, CompletionOutput: 9}.get(cls, 7)
    rows = pickle.loads(pickle.dumps(pack_outputs([out])))
    assert unpack_outputs(rows) == [out]
