"""Log-likelihood scoring through the real ``openai`` client, as evaluation harnesses do it:
``echo`` with ``logprobs`` on ``/v1/completions`` (the prompt tokens' logprobs, None first),
and vLLM's ``prompt_logprobs`` field; both against the offline engine's prompt logprobs."""

from __future__ import annotations

import math

import openai
import pytest
from server_utils import MODEL, Served, metrics

from roofline import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, llm: LLM) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choice = r.choices[0]
    lp = choice.logprobs
    num_prompt = r.usage.prompt_tokens
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(lp.tokens) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:num_prompt]) == PROMPT
    assert lp.text_offset[num_prompt] == len(PROMPT)
    assert all(v <= 0.0 for v in lp.token_logprobs[1:])
    # the same values offline
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids
    offline = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    for a, b in zip(lp.token_logprobs[1:num_prompt], offline, strict=True):
        assert math.isclose(a, b, abs_tol=2e-3)
    # streamed: the prompt and its logprobs arrive in the first chunk
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=0,
            stream=True,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].text.startswith(PROMPT)
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1:num_prompt] == lp.token_logprobs[1:num_prompt]


def test_kv_capacity_metric(server: Served) -> None:
    capacity = metrics(server.base_url)["roofline:kv_cache_capacity_tokens"]
    assert capacity > 0 and capacity % 16 == 0  # pages x page size


def test_prompt_logprobs_field(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    choice = r.choices[0]
    assert not choice.text.startswith(PROMPT)  # no echo
    plp = choice.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    for step in plp[1:]:
        ranks = sorted(v["rank"] for v in step.values())
        assert ranks[:2] == [1, 2] and len(step) in (2, 3)
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in step.values())
