"""Inputs that used to reach a 500 or cost without bound, on the SmolLM2 server: strings that
are not valid Unicode (refused at the edge, field named, nothing added to the engine),
request-supplied chat templates that fail in any way, loop or grow (a 400 within a time bound,
their worker killed), stop strings past the documented bounds, the deprecated function-calling
fields; and the same greedy answer afterwards."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import (
    API_KEY,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    Served,
    assert_openai_error,
    metrics,
    run_in_thread,
)

from roofline.entrypoints.openai.chat_template import TemplateRenderer
from roofline.entrypoints.openai.server import build_app
from roofline.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0}


def post_raw(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """``body`` as JSON with \\uXXXX escapes (lone surrogates stay lone on the wire)."""
    data = json.dumps(body, ensure_ascii=True).encode()
    return http.post(path, content=data, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def greedy_answer(http: httpx.Client, offline: dict) -> str:
    r = http.post(CMPL, json=GREEDY)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text == offline["completions"][3].outputs[0].text
    return text


LONE = "\ud800"
LOW_FIRST = "\udc00\ud83d"
SURROGATE_CASES = [
    ("prompt", CMPL, {"prompt": f"Hello {LONE} world"}, "prompt"),
    ("prompt list, second", CMPL, {"prompt": ["A fine prompt", f"x{LONE}"]}, "prompt"),
    ("prompt list, swapped pair", CMPL, {"prompt": ["ok", LOW_FIRST]}, "prompt"),
    ("model", CMPL, {"prompt": "hi", "model": f"{MODEL}{LONE}"}, "model"),
    ("stop", CMPL, {"prompt": "hi", "stop": ["ok", LONE]}, "stop"),
    ("user", CMPL, {"prompt": "hi", "user": LONE}, "user"),
    ("chat content", CHAT, {"messages": [{"role": "user", "content": f"a{LONE}"}]}, "messages"),
    (
        "chat text part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages",
    ),
    ("chat name", CHAT, {"messages": [{"role": "user", "content": "a", "name": LONE}]}, "messages"),
    ("chat model", CHAT, {"messages": USER, "model": LONE}, "model"),
    ("chat template", CHAT, {"messages": USER, "chat_template": LONE}, "chat_template"),
]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [c[1:] for c in SURROGATE_CASES],
    ids=[c[0] for c in SURROGATE_CASES],
)
def test_lone_surrogates_are_refused_at_the_edge(
    server: Served, http: httpx.Client, greedy_answer: str, path: str, fields: dict, param: str
) -> None:
    before = metrics(server.base_url)["roofline:prompt_tokens_total"]
    body = {"model": MODEL, "max_tokens": 2, **fields}
    err = assert_openai_error(post_raw(http, path, body), 400)
    assert (err["param"], err["code"]) == (param, "invalid_unicode"), err
    assert "surrogate" in err["message"]
    assert metrics(server.base_url)["roofline:prompt_tokens_total"] == before  # nothing ran


def test_surrogate_pair_is_valid_text(http: httpx.Client) -> None:
    r = post_raw(http, CMPL, {"model": MODEL, "prompt": "Smile \ud83d\ude00", "max_tokens": 2})
    assert r.status_code == 200, r.text  # JSON joins the two halves into one code point


def test_engine_adds_no_prompt_of_a_list_with_a_bad_one(server: Served) -> None:
    engine = server.engine
    before = metrics(server.base_url)["roofline:prompt_tokens_total"]

    async def add() -> None:
        await engine.add_requests(
            ["ok-0", "ok-1", "bad-2"], ["One prompt", "Another", f"bad {LONE}"], SamplingParams()
        )

    with pytest.raises(ValueError, match="not valid Unicode"):
        asyncio.run(add())
    assert engine.num_active_streams == 0
    assert metrics(server.base_url)["roofline:prompt_tokens_total"] == before


@pytest.fixture(scope="module")
def trusting(server: Served) -> Iterator[tuple[str, TemplateRenderer]]:
    """A second app on the session's engine that renders request templates, with a short
    time bound and a small output bound."""
    app = build_app(server.engine, api_key=API_KEY, allow_request_chat_template=True)
    renderer = TemplateRenderer(max_workers=1, timeout_s=1.5, max_chars=20_000)
    app.state.serving.template_renderer = renderer
    with run_in_thread(app) as url:
        yield url, renderer


def chat_with(url: str, template: str, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "chat_template": template}
    return httpx.post(
        f"{url}{CHAT}", json=body, timeout=timeout, headers={"Authorization": f"Bearer {API_KEY}"}
    )


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BAD_TEMPLATES = [
    ("division by zero", "{{ 1 // 0 }}", "ZeroDivisionError"),
    ("float overflow", "{{ 10.0 ** 400 }}", "OverflowError"),
    ("sandbox range limit", "{{ range(10 ** 9) | list }}", "OverflowError"),
    ("recursion", "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "Recursion"),
    ("type error", "{{ messages + 1 }}", "TypeError"),
    ("undefined call", "{{ messages.nope() }}", "UndefinedError"),
    ("sandbox escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("syntax", "{% for %}", "TemplateSyntaxError"),
    ("raise_exception", "{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("output too large", "{% for i in range(100000) %}0123456789{% endfor %}", "characters"),
    ("one huge string", "{{ 'x' * 10 ** 10 }}", "MemoryError"),
    ("nested loops", NESTED_LOOPS, "did not render within"),
    ("empty output", "{% if false %}x{% endif %}", "empty prompt"),
]


@pytest.mark.parametrize(
    ("template", "expected"), [c[1:] for c in BAD_TEMPLATES], ids=[c[0] for c in BAD_TEMPLATES]
)
def test_request_template_failures_are_400(
    trusting: tuple[str, TemplateRenderer], template: str, expected: str
) -> None:
    url, renderer = trusting
    t0 = time.monotonic()
    err = assert_openai_error(chat_with(url, template), 400)
    assert expected in err["message"], err
    assert err["param"] == "chat_template"
    assert time.monotonic() - t0 < renderer.timeout_s + 5  # a time bound, not a hang


def test_request_template_works_after_failures(
    trusting: tuple[str, TemplateRenderer], http: httpx.Client
) -> None:
    url, _ = trusting
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    r = chat_with(url, template)
    assert r.status_code == 200, r.text
    plain = http.post(CMPL, json={"prompt": "user: hi\nassistant:", "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_render_of_a_departed_client_is_killed(trusting: tuple[str, TemplateRenderer]) -> None:
    url, renderer = trusting
    renderer.timeout_s = 60.0  # only the client's departure can end this render early
    try:
        with pytest.raises(httpx.ReadTimeout):
            chat_with(url, NESTED_LOOPS, timeout=1.0)
        deadline = time.monotonic() + 10
        while renderer._busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not renderer._busy  # the worker was killed, not left looping for 60 s
    finally:
        renderer.timeout_s = 1.5


def test_stop_string_bounds(http: httpx.Client, greedy_answer: str) -> None:
    too_long = "x" * (MAX_STOP_STRING_CHARS + 1)
    for stop in ([too_long], ["ok"] * (MAX_STOP_STRINGS + 1), ["a", too_long]):
        err = assert_openai_error(http.post(CMPL, json={**GREEDY, "stop": stop}), 400)
        assert err["param"] == "stop", err
    # the most the bounds allow, never matching: the same answer as without stops
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    r = http.post(CMPL, json={**GREEDY, "stop": stops})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_answer


@pytest.mark.parametrize(
    "fields",
    [
        {"functions": [{"name": "f", "parameters": {}}]},
        {"function_call": "auto"},
        {"function_call": {"name": "f"}},
    ],
    ids=["functions", "function_call str", "function_call object"],
)
def test_legacy_function_fields_are_refused(http: httpx.Client, fields: dict) -> None:
    err = assert_openai_error(http.post(CHAT, json={"messages": USER, **fields}), 400)
    assert err["param"] == next(iter(fields)), err


def test_same_answer_after_everything(server: Served, http: httpx.Client, greedy_answer: str):
    assert not server.engine.is_dead
    r = http.post(CMPL, json=GREEDY)
    assert r.json()["choices"][0]["text"] == greedy_answer
