"""Every bad input gets the right 4xx in OpenAI's error shape, and the server keeps serving the
same correct answers afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_utils import (
    API_KEY,
    MAX_BODY_BYTES,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    Served,
    assert_openai_error,
    metrics,
)

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def m(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


# (id, path, JSON body or raw bytes, status, expected param or None, expected code or None)
CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("empty prompt", CMPL, c(prompt=""), 400, "prompt", None),
    ("empty prompt list", CMPL, c(prompt=[]), 400, "prompt", None),
    ("empty prompt in batch", CMPL, c(prompt=["ok", ""]), 400, "prompt", None),
    ("empty token list in batch", CMPL, c(prompt=[[1, 2], []]), 400, "prompt", None),
    ("prompt too long", CMPL, c(prompt="hello " * 9000), 400, None, "context_length_exceeded"),
    ("max_tokens huge", CMPL, c(max_tokens=10**6), 400, None, "context_length_exceeded"),
    ("max_tokens negative", CMPL, c(max_tokens=-1), 400, "max_tokens", None),
    ("max_tokens zero", CMPL, c(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens float", CMPL, c(max_tokens=1.5), 400, "max_tokens", None),
    ("max_tokens string", CMPL, c(max_tokens="4"), 400, "max_tokens", None),
    ("temperature NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    (
        "temperature Infinity",
        CMPL,
        b'{"prompt": "hi", "temperature": Infinity}',
        400,
        "temperature",
        None,
    ),
    ("temperature negative", CMPL, c(temperature=-0.5), 400, "temperature", None),
    ("temperature string", CMPL, c(temperature="hot"), 400, "temperature", None),
    ("top_p zero", CMPL, c(top_p=0), 400, "top_p", None),
    ("top_p two", CMPL, c(top_p=2), 400, "top_p", None),
    ("top_k below -1", CMPL, c(top_k=-5), 400, "top_k", None),
    ("min_p above one", CMPL, c(min_p=1.5), 400, "min_p", None),
    ("presence_penalty 5", CMPL, c(presence_penalty=5), 400, "presence_penalty", None),
    ("repetition_penalty 0", CMPL, c(repetition_penalty=0), 400, "repetition_penalty", None),
    ("n a million", CMPL, c(n=10**6), 400, "n", None),
    ("n zero", CMPL, c(n=0), 400, "n", None),
    ("n bool", CMPL, c(n=True), 400, "n", None),
    ("1000 stop strings", CMPL, c(stop=[f"s{i}" for i in range(1000)]), 400, "stop", None),
    ("empty stop string", CMPL, c(stop=[""]), 400, "stop", None),
    ("stop wrong type", CMPL, c(stop=5), 400, "stop", None),
    ("logprobs 1000", CMPL, c(logprobs=1000), 400, "logprobs", None),
    ("token id out of vocab", CMPL, c(prompt=[10**7]), 400, "prompt", "invalid_token_id"),
    ("negative token id", CMPL, c(prompt=[5, -1]), 400, "prompt", "invalid_token_id"),
    ("stop token id out of vocab", CMPL, c(stop_token_ids=[10**9]), 400, "stop_token_ids", None),
    ("prompt wrong type", CMPL, c(prompt=123), 400, "prompt", None),
    ("prompt mixed list", CMPL, c(prompt=[1, "a"]), 400, "prompt", None),
    ("prompt null", CMPL, c(prompt=None), 400, "prompt", None),
    ("missing prompt", CMPL, {"model": MODEL}, 400, "prompt", None),
    ("too many prompts", CMPL, c(prompt=["hi"] * 300), 400, "prompt", None),
    ("seed string", CMPL, c(seed="abc"), 400, "seed", None),
    ("seed too large", CMPL, c(seed=2**70), 400, "seed", None),
    ("min_tokens above max_tokens", CMPL, c(min_tokens=10), 400, "min_tokens", None),
    ("ignore_eos string", CMPL, c(ignore_eos="yes"), 400, "ignore_eos", None),
    ("priority string", CMPL, c(priority="high"), 400, "priority", None),
    ("prompt_logprobs 1000", CMPL, c(prompt_logprobs=1000), 400, "prompt_logprobs", None),
    ("echo logprobs 1000", CMPL, c(echo=True, logprobs=1000), 400, "logprobs", None),
    ("logit_bias unsupported", CMPL, c(logit_bias={"50": 10}), 400, "logit_bias", None),
    (
        "stream_options without stream",
        CMPL,
        c(stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
    ),
    ("malformed JSON", CMPL, b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("deeply nested JSON", CMPL, b"[" * 100_000, 400, None, None),
    ("body is a list", CMPL, b"[]", 400, None, None),
    ("empty body", CMPL, b"", 400, None, None),
    ("unknown model", CMPL, c(model="gpt-17"), 404, "model", "model_not_found"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("empty messages", CHAT, m(messages=[]), 400, "messages", None),
    ("bad role", CHAT, m(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", None),
    ("message without role", CHAT, m(messages=[{"content": "hi"}]), 400, "messages", None),
    (
        "content wrong type",
        CHAT,
        m(messages=[{"role": "user", "content": 5}]),
        400,
        "messages",
        None,
    ),
    (
        "image content",
        CHAT,
        m(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        400,
        "messages",
        None,
    ),
    ("messages not a list", CHAT, m(messages="hi"), 400, "messages", None),
    (
        "chat max_completion_tokens negative",
        CHAT,
        m(max_completion_tokens=-3),
        400,
        "max_tokens",
        None,
    ),
    ("chat top_logprobs 50", CHAT, m(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("chat top_logprobs without logprobs", CHAT, m(top_logprobs=2), 400, "top_logprobs", None),
    (
        "chat request template refused",
        CHAT,
        m(chat_template="{{ messages }}"),
        400,
        "chat_template",
        None,
    ),
    (
        "chat tool without a function",
        CHAT,
        m(tools=[{"type": "function"}]),
        400,
        "tools[0].function",
        "invalid_value",
    ),
    (
        "chat json_schema without a schema",
        CHAT,
        m(response_format={"type": "json_schema"}),
        400,
        "response_format",
        None,
    ),
    ("chat unknown model", CHAT, m(model="nope"), 404, "model", "model_not_found"),
    (
        "chat too long",
        CHAT,
        m(messages=[{"role": "user", "content": "hello " * 9000}]),
        400,
        None,
        "context_length_exceeded",
    ),
]


@pytest.fixture(scope="module")
def reference(http: httpx.Client, offline: dict) -> str:
    """An answer computed before the bad inputs; it must not change after them."""
    r = http.post(
        CMPL,
        json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert r.status_code == 200
    text = r.json()["choices"][0]["text"]
    assert text == offline["completion_1_alone"][0].outputs[0].text
    return text


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input(
    http: httpx.Client,
    reference: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = assert_openai_error(r, status)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if code == "context_length_exceeded":
        assert "8192" in err["message"], err  # the model's limit ...
        if body.get("max_tokens") == 10**6:
            assert "1000000" in err["message"], err  # ... and what was asked for


def test_count_of_distinct_bad_inputs() -> None:
    assert len({case[0] for case in CASES}) == len(CASES) >= 30


def test_oversized_body(server: Served, http: httpx.Client) -> None:
    big = json.dumps(c(prompt="x" * (MAX_BODY_BYTES + 10))).encode()
    assert_openai_error(
        http.post(CMPL, content=big, headers={"Content-Type": "application/json"}), 413
    )

    def chunks():  # no Content-Length: the limit must hold for a chunked upload too
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(
        f"{server.base_url}{CMPL}",
        content=chunks(),
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert_openai_error(r, 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get(CMPL), 405)
    assert_openai_error(http.get("/v1/models/not-this-model"), 404)


def test_still_serving_after_bad_inputs(server: Served, http: httpx.Client, reference: str) -> None:
    assert not server.engine.is_dead
    assert http.get("/health").status_code == 200
    r = http.post(
        CMPL,
        json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] == reference
    assert metrics(server.base_url)["roofline:num_requests_running"] == 0
