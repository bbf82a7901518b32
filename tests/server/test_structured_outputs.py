"""Structured outputs and tool calling on the real SmolLM2 weights with the real ``openai``
client: JSON schemas (nested objects, arrays, enums, bounded integers, required fields) for 20
prompts in one batch validate with ``jsonschema``; regex, choice and JSON-object answers match;
greedy constrained answers equal offline ``LLM`` ones; a tool round trip (required choice,
streamed deltas, the tool's answer sent back); every bad constraint or tool is a 400 and the
engine keeps serving; constrained rows leave unconstrained neighbours' tokens untouched;
n > 1, sampling, logprobs and preemption under a constraint."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from server_utils import assert_openai_error

from roofline import LLM, SamplingParams
from roofline.structured_output import StructuredOutputsParams

MAX_TOKENS = 48


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SCHEMAS = {
    "nested": _obj(
        {"person": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})}
    ),
    "array": _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}}),
    "bounded": _obj(
        {"score": {"type": "integer", "minimum": 1, "maximum": 10}, "note": NAME}, ["score"]
    ),
}
TOPICS = ["a famous painter", "the ocean", "a small dog", "a rainy city", "a chess player"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _json_answer(client: openai.OpenAI, name: str) -> list[str]:
    prompts = [f"Describe {t} as JSON ({name}):" for t in TOPICS]
    r = client.completions.create(
        model=None,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": SCHEMAS[name]},
            }
        },
    )
    assert all(c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_json_schemas_validate_for_20_prompts(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all 20 prompts in the engine at once
        answers = dict(zip(SCHEMAS, pool.map(lambda n: _json_answer(client, n), SCHEMAS)))
    for name, texts in answers.items():
        assert len(texts) == len(TOPICS)
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_regex_choice_and_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Give me a phone number."}],
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
        max_tokens=8,
        temperature=0.9,
        seed=3,
        n=3,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in r.choices)
    r = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "A JSON object about cats, please."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


def test_greedy_constrained_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    schema = SCHEMAS["nested"]
    messages = [{"role": "user", "content": "Invent a person and give them as JSON."}]
    served = client.chat.completions.create(
        model=None,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_json": schema},
    )
    offline = llm.chat(
        [messages],
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=schema),
        ),
        use_tqdm=False,
    )
    assert served.choices[0].message.content == offline[0].outputs[0].text
    jsonschema.validate(json.loads(offline[0].outputs[0].text), schema)


def test_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=None,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(
        model=None,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    name, args, ids, finish, content = None, "", set(), None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                    name = tc.function.name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, args, finish, content) == (
        "get_weather",
        call.function.arguments,
        "tool_calls",
        "",
    )
    assert len(ids) == 1

    named = client.chat.completions.create(
        model=None,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    (named_call,) = named.choices[0].message.tool_calls
    jsonschema.validate(
        json.loads(named_call.function.arguments), WEATHER["function"]["parameters"]
    )

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    final = client.chat.completions.create(
        model=None,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    message = final.choices[0].message
    assert message.content and not message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"guided_regex": "a(b"}, "guided_regex"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            "guided_json",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)
def test_bad_constraints_are_400(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert assert_openai_error(r, 400)["param"] == param


def test_deep_schema_400_and_engine_serves_on(http: httpx.Client) -> None:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_json": deep})
    err = assert_openai_error(r, 400)
    assert err["param"] == "guided_json" and "deeper" in err["message"]
    # unsatisfiable within max_tokens: cut by length, not a hang
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_regex": "a{40}"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200


def test_mixed_batch_leaves_unconstrained_rows_alone(llm: LLM) -> None:
    free = ["The capital of France is", "My favourite food is", "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(free, plain, use_tqdm=False)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,12}"),
    )
    mixed = llm.generate(
        free + ["Pick a number:"] * 2, [plain] * 3 + [constrained] * 2, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(r"[0-9]{2,12}", o.outputs[0].text) for o in mixed[3:])


def test_sampled_n_logprobs_and_preemption(llm: LLM) -> None:
    schema = SCHEMAS["enum"]
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=2,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    (out,) = llm.generate(["A color and whether you are sure, as JSON:"], params, use_tqdm=False)
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
        assert len(c.logprobs) == len(c.token_ids)
        # the sampled token is always allowed, so its masked logprob is finite
        assert all(step[t].logprob > -1e9 for step, t in zip(c.logprobs, c.token_ids))
    # a KV pool of a few pages: requests are preempted and recomputed mid-answer; async
    # scheduling: the mask waits for the previous step inside the launch
    small = LLM(num_pages=8, max_model_len=128, max_num_seqs=4, async_scheduling=True)
    # ~25-token prompts: 4 requests fill the 8 pages, growing past 32 tokens preempts
    prompts = [
        f"Here is a made-up person who likes {t}, written as one JSON object with a name and "
        "an age:"
        for t in TOPICS[:4]
    ]
    greedy = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]),
    )
    outs = small.generate(prompts, greedy, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])


def test_offline_chat_tools(llm: LLM, client: openai.OpenAI) -> None:
    """``LLM.chat(tools=...)``: the server's rendering, constraint and parsing offline; the
    same greedy call as the server's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (out,) = llm.chat(ASK, greedy, tools=[WEATHER], tool_choice="required", use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "tool_calls" and not completion.content
    (call,) = completion.tool_calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    served = client.chat.completions.create(
        model=None,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert json.loads(served.choices[0].message.tool_calls[0].function.arguments) == arguments

    named = {"type": "function", "function": {"name": "get_weather"}}
    (out,) = llm.chat(ASK, greedy, tools=[WEATHER], tool_choice=named, use_tqdm=False)
    (call,) = out.outputs[0].tool_calls
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
    )

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'},
    ]
    short = SamplingParams(temperature=0.0, max_tokens=16)
    (final,) = llm.chat(history, short, tools=[WEATHER], tool_choice="none", use_tqdm=False)
    assert final.outputs[0].text and final.outputs[0].tool_calls is None
    (plain,) = llm.chat(ASK, short, use_tqdm=False)  # no tools: untouched outputs
    assert plain.outputs[0].tool_calls is None and plain.outputs[0].content is None

    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat(
            ASK,
            greedy,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        llm.chat(ASK, greedy, tool_choice="required")
