"""The llguidance backend behind the same interface as xgrammar (runs when llguidance is
installed; the ``test`` extra installs it): constraints compile and bad ones are refused, a
random walk through each grammar only ever sees allowed tokens, proposals are checked and rolled
back, and the engine with ``structured_outputs_backend="llguidance"`` answers JSON that
validates (SmolLM2's real tokenizer)."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.engine.args import EngineArgs  # noqa: E402
from roofline.models.weights import gguf_path, load_tokenizer, resolve_model  # noqa: E402
from roofline.structured_output import StructuredOutputsParams  # noqa: E402
from roofline.structured_output.backend import make_backend  # noqa: E402
from roofline.structured_output.mask_table import MaskTable  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(str(gguf_path())))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return make_backend("llguidance", tokenizer, 49152, [tokenizer.eos_token_id])


def _walk(backend, tokenizer, params: StructuredOutputsParams, seed: int) -> str:
    """Random allowed tokens until the grammar ends; the text they make."""
    matcher = backend.matcher(backend.compile(params))
    table = MaskTable(backend, initial_slots=1)
    slot = table.acquire(matcher)
    rng = random.Random(seed)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(200):
        table.finish_fill()
        bits = ((table.bitmask[slot].unsqueeze(-1) >> shifts) & 1).flatten()[:49152]  # [V]
        allowed = bits.nonzero().flatten().tolist()
        assert allowed
        token = rng.choice(allowed)
        if token != tokenizer.eos_token_id and rng.random() < 0.3 and len(allowed) > 1:
            stop_ok = tokenizer.eos_token_id in allowed
            token = tokenizer.eos_token_id if stop_ok else token
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        out.append(token)
        table.mark_dirty(slot, matcher)
    assert matcher.is_terminated()
    return tokenizer.decode(out)


def test_constraints_walk_and_match(backend, tokenizer) -> None:
    for seed in range(3):
        text = _walk(backend, tokenizer, StructuredOutputsParams(json=SCHEMA), seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        text = _walk(backend, tokenizer, StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-c]+"), seed)
        assert __import__("re").fullmatch(r"[0-9]{2,4}-[a-c]+", text), text
        choice = StructuredOutputsParams(choice=["red apple", "green", 'say "hi"'])
        assert _walk(backend, tokenizer, choice, seed) in ("red apple", "green", 'say "hi"')
    grammar = StructuredOutputsParams(grammar='root ::= "yes" | "no"')
    assert _walk(backend, tokenizer, grammar, 0) in ("yes", "no")


def test_bad_constraints_refused(backend) -> None:
    with pytest.raises(ValueError, match="regex"):
        backend.validate(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="grammar"):
        backend.validate(StructuredOutputsParams(grammar="root ::= undefined_rule"))


def test_proposals_checked_and_rolled_back(backend, tokenizer) -> None:
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["hello world"])))
    good = tokenizer.encode("hello world", add_special_tokens=False)
    bad = good[:1] + tokenizer.encode(" there", add_special_tokens=False)
    assert matcher.count_valid_prefix(good + [tokenizer.eos_token_id, 5]) == len(good) + 1
    assert matcher.count_valid_prefix(bad) == 1
    assert not matcher.accept_token(bad[1])  # refused, state unchanged
    for token in good:
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()


def test_backend_selected_by_name() -> None:
    assert (
        EngineArgs(
            structured_outputs_config={"backend": "llguidance"}
        ).resolve_structured_outputs_backend()
        == "llguidance"
    )
    with pytest.raises(ValueError, match="backend"):
        EngineArgs(structured_outputs_backend="outlines").resolve_structured_outputs_backend()
    with pytest.raises(ValueError, match="backend"):
        LLM(structured_outputs_config='{"backend": "guidance"}')


def test_engine_answers_validate() -> None:
    llm = LLM(structured_outputs_backend="llguidance")
    assert llm.llm_engine.grammars.manager.backend.name == "llguidance"
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so)
    prompts = ["Describe a person as JSON:", "A JSON record of a cat:", "Give me JSON:"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
