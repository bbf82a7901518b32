"""Many clients at once, and clients that leave: 64 concurrent streams give exactly the offline
greedy answers, and a disconnect (streaming or not) aborts the request and frees its KV pages
(read back from ``/metrics``)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_utils import API_KEY, CHATS, MAX_TOKENS, MODEL, PROMPTS, Served, metrics, wait_idle

NUM_CLIENTS = 64


def test_64_concurrent_streams_match_offline(server: Served, offline: dict) -> None:
    assert len(PROMPTS) == NUM_CLIENTS
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=600
    )

    async def one(prompt: str) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reason, tokens = "", None, -1
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    async def main() -> list[tuple[str, str | None, int]]:
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == NUM_CLIENTS
    for prompt, ref, (text, reason, tokens) in zip(
        PROMPTS, offline["completions"], results, strict=True
    ):
        expected = ref.outputs[0]
        assert text == expected.text, prompt
        assert reason == expected.finish_reason, prompt
        assert tokens == len(expected.token_ids), prompt
    m = wait_idle(server.base_url)
    assert m["roofline:num_requests_running"] == 0
    assert m["roofline:time_to_first_token_seconds_count"] >= NUM_CLIENTS
    assert m["roofline:generation_tokens_total"] >= NUM_CLIENTS


def test_chat_matches_offline_chat(client: openai.OpenAI, offline: dict) -> None:
    for messages, ref in zip(CHATS, offline["chat"], strict=True):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_stop_token_ids(client: openai.OpenAI, offline: dict) -> None:
    expected = offline["completions"][0].outputs[0]
    stop_id = expected.token_ids[2]
    first = expected.token_ids.index(stop_id)
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop_id
    assert r.usage.completion_tokens == first + 1  # the stop token is generated, then it ends


def _aborts(base_url: str) -> float:
    return metrics(base_url)["roofline:request_success_total{finished_reason=abort}"]


def test_streaming_disconnect_frees_kv(server: Served, client: openai.OpenAI) -> None:
    before = _aborts(server.base_url)
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=4000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for p in PROMPTS[:4]
    ]
    for s in streams:
        for _, _chunk in zip(range(2), s, strict=False):
            pass
    m = metrics(server.base_url)
    assert m["roofline:num_requests_running"] + m["roofline:num_requests_waiting"] == 4
    assert m["roofline:kv_cache_usage_perc"] > 0
    for s in streams:
        s.close()
    m = wait_idle(server.base_url)
    assert m["roofline:num_requests_running"] == 0
    assert m["roofline:num_requests_waiting"] == 0
    assert m["roofline:kv_cache_usage_perc"] == 0
    assert _aborts(server.base_url) == before + 4


def test_non_streaming_disconnect_frees_kv(
    server: Served, client: openai.OpenAI, offline: dict
) -> None:
    before = _aborts(server.base_url)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[5],
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions",
            json=body,
            timeout=3,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    m = wait_idle(server.base_url)
    assert m["roofline:num_requests_running"] == 0
    assert m["roofline:kv_cache_usage_perc"] == 0
    assert _aborts(server.base_url) == before + 1
    # still serving, with the same answers
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].text == offline["completions"][0].outputs[0].text
