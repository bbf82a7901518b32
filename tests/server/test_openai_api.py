"""The real ``openai`` client against a real server: completions and chat, streamed and not,
n > 1, logprobs, stop strings, seeds, batches, token-id prompts, usage and the API key."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import (
    API_KEY,
    MODEL,
    Served,
    assert_openai_error,
    metrics,
    run_in_thread,
    wait_idle,
)

from roofline.entrypoints.openai.server import build_app

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_health_models_and_auth(server: Served, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # no key needed
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401, path
        key = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.get(f"{server.base_url}{path}", headers=key).status_code == 200, path
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 8192
    assert client.models.retrieve(MODEL).id == MODEL
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            headers=headers,
            json={"prompt": "hi", "max_tokens": 1},
        )
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 8
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.completion_tokens <= 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # max_completion_tokens is the newer name of the same cap
    short = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=3
    )
    assert short.usage.completion_tokens == 3 and msg.content.startswith(
        short.choices[0].message.content
    )


def test_n_completions_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", n=3, max_tokens=6, temperature=1.0, seed=11
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=11,
            stream=True,
        )
    )
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert texts == {c.index: c.text for c in r.choices}  # same seed, same samples
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_tokens=4, temperature=0.7, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert logprob <= 0
        assert top[tok] == pytest.approx(max(top.values()))  # greedy picks the top token
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, stream=True
        )
    )
    tokens = [
        t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])
    ]
    assert tokens == lp.tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token
        assert t.bytes == list(t.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_strings(client: openai.OpenAI) -> None:
    base = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
        .choices[0]
        .text
    )
    word = base.split()[2]  # a word from the middle of the greedy answer
    cut = base[: base.index(word)]
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[word, "never-appears"]
    )
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == word
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=word, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt="My favourite animal is",
                max_tokens=12,
                temperature=1.0,
                seed=seed,
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1


def test_batch_prompts_and_token_ids(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "1, 2, 3, 4,"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        assert r.choices[i].text == alone.choices[0].text
    ids = client.completions.create(
        model=MODEL, prompt=[504, 3458, 282, 4649], max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3
    two = client.completions.create(
        model=MODEL, prompt=[[504, 3458], [282, 4649]], max_tokens=2, temperature=0, n=2
    )
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    assert two.usage.prompt_tokens == 4


def test_sampling_knobs_accepted(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=5,
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 4,
            "ignore_eos": True,
            "priority": 1,
            "some_unknown_field": [1, 2],
        },
    )
    assert r.usage.completion_tokens == 4


def test_request_chat_template_only_when_allowed(server: Served, client: openai.OpenAI) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(openai.BadRequestError, match="not allowed"):
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"chat_template": template}
        )
    # a second app on the same engine, whose operator allows request templates
    app = build_app(server.engine, api_key=API_KEY, allow_request_chat_template=True)
    with run_in_thread(app) as url:
        trusting = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        r = trusting.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=3,
            temperature=0,
            extra_body={"chat_template": template},
        )
        plain = client.completions.create(
            model=MODEL,
            prompt="user: Name three colors.\nassistant:",
            max_tokens=3,
            temperature=0,
        )
        assert r.choices[0].message.content == plain.choices[0].text
        for evil in (
            "{{ ''.__class__.__mro__[1].__subclasses__() }}",
            "{{ raise_exception('no system messages') }}",
            "{% for %}",
        ):
            with pytest.raises(openai.BadRequestError):
                trusting.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=2, extra_body={"chat_template": evil}
                )


def test_metrics_names_mirror_vllm(server: Served, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    m = metrics(server.base_url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"roofline:{name}" in m
    for name in (
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert f"roofline:{name}_total" in m
    assert m["roofline:generation_tokens_total"] >= 3
    assert m["roofline:prefix_cache_queries_total"] >= m["roofline:prefix_cache_hits_total"]
    assert m["roofline:request_success_total{finished_reason=length}"] >= 1
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert m[f"roofline:{name}_count"] >= 1, name
        assert m[f"roofline:{name}_sum"] >= 0, name


def test_metrics_count_every_request_and_step(server: Served, client: openai.OpenAI) -> None:
    """The histograms are fed from the core's per-step messages, for streamed and whole answers
    alike: one TTFT / TPOT / E2E / queue sample per request, one ITL sample per later step."""
    before = metrics(server.base_url)
    for stream in (False, True):
        for i in range(3):
            r = client.completions.create(
                model=MODEL,
                prompt=f"{PROMPT} {i}",
                max_tokens=5,
                temperature=0,
                stream=stream,
                extra_body={"ignore_eos": True},
            )
            if stream:
                list(r)
    after = wait_idle(server.base_url)

    def grew(name: str) -> float:
        return after[name] - before[name]

    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert grew(f"roofline:{name}_seconds_count") == 6, name
    assert grew("roofline:request_queue_time_seconds_count") == 6
    assert grew("roofline:inter_token_latency_seconds_count") == 6 * 4
    assert grew("roofline:generation_tokens_total") == 6 * 5
    assert grew("roofline:request_success_total{finished_reason=length}") == 6
