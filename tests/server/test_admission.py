"""Admission, on the tiny random-weight core: a request's prompts are admitted together or not at
all (a bad prompt, a full waiting queue), the fan-out limit, a client that leaves at once gets
nothing run, and the edge of the HTTP layer (the API key's open and closed paths, JSON bodies
whatever their Content-Type says)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
from server_utils import (
    TINY_KV_BYTES,
    assert_openai_error,
    metrics,
    run_in_thread,
    slow_steps,
    wait_idle,
)

from roofline.engine.args import EngineArgs
from roofline.engine.async_engine import AsyncLLMEngine
from roofline.entrypoints.openai.server import build_app
from roofline.sampling_params import SamplingParams

CMPL = "/v1/completions"
KEY = "admission-key"


def body(**fields: object) -> dict[str, object]:
    return {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields}


def counts(url: str) -> tuple[float, float]:
    m = metrics(url)
    return m["roofline:prompt_tokens_total"], m["roofline:generation_tokens_total"]


def test_prompts_are_admitted_together_or_not_at_all(tiny_core: AsyncLLMEngine) -> None:
    with run_in_thread(build_app(tiny_core)) as url, httpx.Client(base_url=url, timeout=60) as c:
        before = counts(url)
        # the third prompt cannot fit the context: the core refuses it and its siblings
        for prompts in ([[5, 6], [7, 8], [9] * 300], [[9] * 300, [5, 6]]):
            err = assert_openai_error(c.post(CMPL, json=body(prompt=prompts)), 400)
            assert "256" in err["message"], err
        assert counts(url) == before
        assert tiny_core.num_active_streams == 0

        async def add_with_crash() -> None:  # an add that crashes in the core (not bad input)
            await tiny_core.add_requests(["fine", "crash"], [[5], [6]], SamplingParams())

        with pytest.raises(TypeError, match="injected"):
            asyncio.run(add_with_crash())
        assert counts(url) == before
        assert tiny_core.num_active_streams == 0
        r = c.post(CMPL, json=body(prompt=[[5, 6], [7, 8]], n=2))
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def test_full_queue_refuses_the_whole_request(tiny_model: str) -> None:
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model, kv_cache_memory_bytes=TINY_KV_BYTES, max_num_seqs=1, max_num_waiting=3
        ),
        core_setup=slow_steps,
    )
    try:
        with (
            run_in_thread(build_app(engine, max_seqs_per_request=8)) as url,
            httpx.Client(base_url=url, timeout=60) as c,
        ):
            before = counts(url)
            err = assert_openai_error(c.post(CMPL, json=body(prompt=[[5]] * 5)), 429)
            assert err["code"] == "queue_full"
            err = assert_openai_error(c.post(CMPL, json=body(n=4)), 429)
            assert wait_idle(url)["roofline:num_requests_waiting"] == 0
            assert counts(url) == before  # not one of their sequences ran
            r = c.post(CMPL, json=body(prompt=[[5], [6], [7]]))  # the queue holds 3
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


def test_fan_out_limit(tiny_core: AsyncLLMEngine) -> None:
    with (
        run_in_thread(build_app(tiny_core, max_seqs_per_request=4)) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        for fields in ({"n": 5}, {"prompt": [[5]] * 3, "n": 2}, {"prompt": [[5]] * 5}):
            err = assert_openai_error(c.post(CMPL, json=body(**fields)), 400)
            assert err["code"] == "too_many_sequences" and "at most 4" in err["message"], err
        assert c.post(CMPL, json=body(prompt=[[5]] * 2, n=2)).status_code == 200
    with run_in_thread(build_app(tiny_core)) as url:  # the default: 256
        r = httpx.post(f"{url}{CMPL}", json=body(prompt=[[5]] * 200, n=2), timeout=60)
        assert_openai_error(r, 400)


def send_and_leave(url: str, payload: dict[str, object]) -> None:
    """Send a whole request and close the connection without reading the answer."""
    data = json.dumps(payload).encode()
    parts = urlparse(url)
    with socket.create_connection((parts.hostname, parts.port)) as s:
        s.sendall(
            f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )


@pytest.fixture(scope="module")
def slow_core(tiny_model: str) -> Iterator[AsyncLLMEngine]:
    """A tiny core whose steps take 50 ms more (requests stay running while a test acts)."""
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model, kv_cache_memory_bytes=TINY_KV_BYTES), core_setup=slow_steps
    )
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": [[5, 6, 7, 8 + i] for i in range(64)]},
        {"n": 64},
        {"prompt": [[5, 6, 7, 8 + i] for i in range(32)], "n": 2, "stream": True},
    ],
    ids=["64 prompts", "n=64", "32 prompts x n=2 streamed"],
)
def test_client_that_leaves_at_once_gets_nothing_run(
    slow_core: AsyncLLMEngine, fields: dict[str, object]
) -> None:
    engine = slow_core
    with run_in_thread(build_app(engine)) as url:
        before = counts(url)
        for _ in range(3):
            send_and_leave(url, body(max_tokens=200, **fields))
        time.sleep(1.0)  # 20 slow steps, had anything been admitted
        m = wait_idle(url)
        after = m["roofline:prompt_tokens_total"], m["roofline:generation_tokens_total"]
        # at most one step of each request (64 sequences) may slip in before its abort: never
        # the whole 64 x 200 tokens of each of the three (15,716 ran without the watch)
        assert after[1] - before[1] <= 3 * 64, (before, after)
        assert engine.num_active_streams == 0


def test_api_key_paths(tiny_core: AsyncLLMEngine) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with run_in_thread(build_app(tiny_core, api_key=KEY)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
            assert_openai_error(httpx.get(f"{url}{path}"), 401)
            assert httpx.get(f"{url}{path}", headers=auth).status_code == 200, path
        assert_openai_error(httpx.post(f"{url}{CMPL}", json=body()), 401)
    with run_in_thread(build_app(tiny_core, api_key=KEY, public_docs_and_metrics=True)) as url:
        for path in ("/health", "/metrics", "/docs", "/openapi.json"):
            assert httpx.get(f"{url}{path}").status_code == 200, path
        assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
        assert_openai_error(httpx.post(f"{url}{CMPL}", json=body()), 401)


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "text/plain", "application/json; charset=utf-8"],
)
def test_json_body_whatever_the_content_type(
    tiny_core: AsyncLLMEngine, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    with run_in_thread(build_app(tiny_core)) as url:
        r = httpx.post(f"{url}{CMPL}", content=json.dumps(body()).encode(), headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(f"{url}{CMPL}", content=b"prompt=hello", headers=headers)
        assert assert_openai_error(r, 400)["code"] == "invalid_json"
