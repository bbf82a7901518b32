"""A bounded property-based fuzz of the server's own OpenAPI schema: hypothesis draws request
bodies from each POST endpoint's JSON schema (read from ``/openapi.json``), then mutates them
(wrong types, missing required fields, unknown fields, out-of-range numbers). No answer may be a
5xx, every 4xx must be in OpenAI's error shape, and a 200 stream must end with ``[DONE]`` and
carry no error event. Token counts are drawn small so generation stays cheap on a CPU."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import MODEL, Served, assert_openai_error, metrics

JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20)
)
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
TOKEN_ID = st.integers(0, 49151)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
        "content": st.one_of(
            st.text(max_size=30),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
                max_size=2,
            ),
        ),
    }
)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), st.none()),
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.one_of(st.integers(1, 3), st.none()),
    "n": st.integers(1, 2),
    "temperature": st.one_of(st.none(), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 1),
    "stop": st.one_of(
        st.none(),
        st.text(min_size=1, max_size=4),
        st.lists(st.text(min_size=1, max_size=4), max_size=3),
    ),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "seed": st.one_of(st.none(), st.integers(0, 2**32)),
    "prompt": st.one_of(
        st.text(min_size=1, max_size=40),
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=2),
        st.lists(TOKEN_ID, min_size=1, max_size=8),
        st.lists(st.lists(TOKEN_ID, min_size=1, max_size=4), min_size=1, max_size=2),
    ),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.just({"type": "text"}),
    "top_logprobs": st.integers(0, 3),
    **{
        name: st.none()
        for name in ("logit_bias", "suffix", "best_of", "tools", "tool_choice", "chat_template")
    },
    "echo": st.just(False),
}
"""Values that are valid on their own (combinations may still be refused)."""
ALWAYS = ("max_tokens",)
"""Never left out: without it chat would generate up to the model's length."""
EXTREME = st.sampled_from(
    [
        -1,
        0,
        10**6,
        2**70,
        -1e30,
        1e30,
        float("inf"),
        float("nan"),
        "",
        [],
        {},
        None,
        True,
        "x" * 300,
    ]
)


def from_schema(
    schema: dict[str, Any], defs: dict[str, Any], depth: int = 0
) -> st.SearchStrategy[Any]:
    """A strategy for the JSON Schema subset pydantic emits."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        return st.one_of(st.integers(-5, 60000), st.integers(-(2**70), 2**70))
    if kind == "number":
        return st.one_of(st.floats(-3, 3), st.floats())
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = schema.get("items", {})
        return st.lists(
            from_schema(items, defs, depth + 1) if depth < 3 else JSON_LEAF,
            min_size=schema.get("minItems", 0),
            max_size=4,
        )
    if kind == "object" and "properties" in schema:
        return object_from_schema(schema, defs, depth)
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), JSON_LEAF, max_size=3)
    return ANY_JSON


def object_from_schema(
    schema: dict[str, Any], defs: dict[str, Any], depth: int
) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with a random subset of the properties. At the top level the values are valid
    on their own (``VALID``, else the schema's type) and half the bodies then get one
    mutation: a wrong type, an extreme value, a dropped required field or an unknown field."""
    props = schema["properties"]
    required = set(schema.get("required", ()))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, sub in props.items():
            keep = name in required or (depth == 0 and name in ALWAYS)
            if not keep and draw(st.integers(0, 3)) != 0:
                continue
            if depth == 0 and name in VALID:
                out[name] = draw(VALID[name])
            else:
                out[name] = draw(from_schema(sub, defs, depth + 1))
        if depth == 0 and out:
            mutation = draw(st.sampled_from(["none", "none", "type", "extreme", "drop", "unknown"]))
            name = draw(st.sampled_from(sorted(out)))
            if mutation == "type":
                out[name] = draw(ANY_JSON)
            elif mutation == "extreme":
                out[name] = draw(EXTREME)
            elif mutation == "drop" and name not in ALWAYS:
                del out[name]
            elif mutation == "unknown":
                out[draw(st.text(min_size=1, max_size=10))] = draw(ANY_JSON)
        return out

    return build()


@pytest.fixture(scope="module")
def openapi(http: httpx.Client) -> dict[str, Any]:
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    return spec


def body_strategy(spec: dict[str, Any], path: str) -> st.SearchStrategy[dict[str, Any]]:
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return from_schema(schema, spec["components"]["schemas"])


def check(response: httpx.Response, streamed: bool) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
        return
    if not streamed:
        assert "choices" in response.json()
        return
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", response.text[-500:]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_post_endpoints(
    server: Served, http: httpx.Client, openapi: dict[str, Any], path: str
) -> None:
    statuses: list[int] = []

    @FUZZ
    @given(body=body_strategy(openapi, path))
    def one(body: dict[str, Any]) -> None:
        r = http.post(
            path,
            content=json.dumps(body).encode(),  # Infinity stays in
            headers={"Content-Type": "application/json"},
        )
        statuses.append(r.status_code)
        check(
            r,
            streamed=body.get("stream") is True
            and r.status_code == 200
            and r.headers.get("content-type", "").startswith("text/event-stream"),
        )

    one()
    print(path, sorted(statuses))
    assert statuses.count(200) >= 5, statuses  # the fuzz reaches the engine, not only 400s
    assert not server.engine.is_dead
    assert metrics(server.base_url)["roofline:num_requests_running"] == 0


def test_fuzz_raw_bodies_and_model_paths(server: Served, http: httpx.Client) -> None:
    @FUZZ
    @given(
        raw=st.one_of(st.binary(max_size=200), ANY_JSON.map(lambda v: json.dumps(v).encode())),
        model_id=st.text(min_size=1, max_size=30),
    )
    def one(raw: bytes, model_id: str) -> None:
        for path in ("/v1/completions", "/v1/chat/completions"):
            check(
                http.post(path, content=raw, headers={"Content-Type": "application/json"}),
                streamed=False,
            )
        r = http.get(f"/v1/models/{quote(model_id, safe='')}")
        assert r.status_code in (200, 404), r.text
        if r.status_code == 404:
            assert_openai_error(r, 404)

    one()
    assert not server.engine.is_dead
