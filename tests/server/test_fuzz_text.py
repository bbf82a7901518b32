"""A property-based test over request bodies whose string fields hold what JSON can carry but
text should not: lone UTF-16 surrogates (either half, or a pair in the wrong order), NUL, invalid
escapes (``\\q``, a short ``\\u``), and very long values. Every answer is a 2xx or a 4xx in
OpenAI's shape, never a 5xx, and afterwards a normal greedy request gets the same answer."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import MODEL, PROMPTS, Served, assert_openai_error, metrics

BAD_ESCAPE = "@@bad-escape@@"
SHORT_U = "@@short-u@@"
ATOMS = st.sampled_from(
    ["\ud800", "\udfff", "\udc00\ud83d", "\ud83d\ude00", "\x00", "a\x00b", BAD_ESCAPE, SHORT_U]
)
LONG = st.builds(
    lambda unit, count: unit * count,
    st.sampled_from(["x ", "\x00 ", "é ", "\ud800"]),
    st.sampled_from([20_000, 60_000]),
)
"""Long enough to be over the context length (or the stop-string bound) as text."""
NASTY = st.one_of(
    st.text(max_size=12),
    ATOMS,
    st.lists(st.one_of(ATOMS, st.text(max_size=4)), min_size=1, max_size=4).map("".join),
    LONG,
)
WORDS = st.sampled_from(["Hello", "The sea is", "A cat"])
"""Plain text, so that some bodies are valid and reach the engine."""


def text() -> st.SearchStrategy[str]:
    return st.one_of(WORDS, NASTY)


def maybe(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


COMMON = {
    "model": st.one_of(st.just(MODEL), NASTY),
    "stop": st.one_of(text(), st.lists(text(), max_size=3)),
    "user": text(),
}
COMPLETION = st.tuples(
    st.just("/v1/completions"),
    st.fixed_dictionaries(
        {"prompt": st.one_of(text(), st.lists(text(), min_size=1, max_size=3))},
        optional=COMMON,
    ),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": text()},
    optional={"name": text()},
)
CHAT = st.tuples(
    st.just("/v1/chat/completions"),
    st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, min_size=1, max_size=2)},
        optional={**COMMON, "chat_template": text()},
    ),
)


def encode(body: dict[str, Any]) -> bytes:
    """JSON with \\uXXXX escapes (lone surrogates stay lone), then the invalid escapes."""
    raw = json.dumps(body, ensure_ascii=True)
    return raw.replace(BAD_ESCAPE, "\\q").replace(SHORT_U, "\\u12G4").encode()


GREEDY = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0}


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=st.one_of(COMPLETION, CHAT))
def _one(http: httpx.Client, statuses: list[int], request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    body = {**body, "max_tokens": 1, "temperature": 0}
    r = http.post(path, content=encode(body), headers={"Content-Type": "application/json"})
    statuses.append(r.status_code)
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        assert r.json()["choices"], r.text
    else:
        assert_openai_error(r, r.status_code)


def test_hostile_strings_never_5xx(server: Served, http: httpx.Client) -> None:
    before = http.post("/v1/completions", json=GREEDY)
    assert before.status_code == 200, before.text
    statuses: list[int] = []
    _one(http, statuses)
    assert 200 in statuses and 400 in statuses, statuses  # both sides were reached
    after = http.post("/v1/completions", json=GREEDY)
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert not server.engine.is_dead
    assert metrics(server.base_url)["roofline:num_requests_running"] == 0
