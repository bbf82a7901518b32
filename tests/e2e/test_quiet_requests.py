"""Quiet requests (``stream=False``, no logprobs, stop strings or grammar): ``Scheduler.update``
reports them only on their first token, on verification rows and when they finish, and the
engine decodes their text only then (all the unreported tokens in one detokenizer update).
What the user sees must not change: the same final outputs (text through a byte-level
tokenizer, whose random bytes split multi-byte characters), token ids, finish reasons and
engine token counters as streamed requests."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput
from roofline.core.scheduler import Scheduler
from roofline.engine.args import EngineArgs
from roofline.engine.core_messages import pack_outputs
from roofline.engine.llm_engine import LLMEngine
from roofline.request import Request
from roofline.sampling_params import SamplingParams

VOCAB = 257  # 256 bytes + <eos>
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 256,
}


def _byte_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([], trainer)
    tok.add_special_tokens(["<eos>"])
    assert tok.get_vocab_size() == VOCAB
    return tok


def _engine(tmp_path, async_scheduling: bool) -> LLMEngine:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine(
        EngineArgs(
            model=str(tmp_path), load_format="dummy", device="cpu", dtype="float32",
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
            async_scheduling=async_scheduling, num_pages=40,
        )
    )  # fmt: skip
    engine.tokenizer = _byte_tokenizer()  # detokenizers for the requests added from now on
    return engine


def _run(engine: LLMEngine, stream: bool, tag: str) -> dict[str, tuple]:
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(10)]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=10 + 7 * i, ignore_eos=i % 3 == 0)
        if i == 4:
            params = SamplingParams(temperature=0.0, max_tokens=30, n=2, seed=5)
        engine.add_request(f"{tag}{i}", prompt, params, stream=stream)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                key = out.request_id.removeprefix(tag)
                final[key] = [(c.text, c.token_ids, c.finish_reason) for c in out.outputs]
    return final


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_quiet_outputs_match_streamed(tmp_path, async_scheduling: bool) -> None:
    engine = _engine(tmp_path, async_scheduling)
    before = engine.get_stats()
    streamed = _run(engine, True, "s")
    mid = engine.get_stats()
    quiet = _run(engine, False, "q")
    after = engine.get_stats()
    assert quiet == streamed and len(quiet) == 10
    texts = [t for outs in quiet.values() for t, _, _ in outs]
    assert any(ord(ch) > 127 and ch != "\ufffd" for t in texts for ch in t)  # joined bytes
    assert (
        after.generation_tokens_total - mid.generation_tokens_total
        == mid.generation_tokens_total - before.generation_tokens_total
        == sum(len(ids) for outs in quiet.values() for _, ids, _ in outs)
    )
    assert (
        after.prompt_tokens_total - mid.prompt_tokens_total
        == mid.prompt_tokens_total - before.prompt_tokens_total
    )


def test_scheduler_reports_quiet_requests_on_first_token_and_finish() -> None:
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(16, 4, True), 4)
    quiet = Request("q", [1, 2, 3], SamplingParams(), max_tokens=6, quiet=True)
    loud = Request("l", [1, 2, 3], SamplingParams(), max_tokens=6)
    sched.add_request(quiet)
    sched.add_request(loud)
    reported: dict[str, list[list[int]]] = {"q": [], "l": []}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {e.request.request_id: 9 for e in out.scheduled if e.samples}
        for upd in sched.update(out, ModelRunnerOutput(sampled)):
            reported[upd.request.request_id].append(upd.new_token_ids)
    assert reported["l"] == [[9]] * 6
    assert reported["q"] == [[9], [9]]  # its first token, then the one that finished it
    assert quiet.output_token_ids == [9] * 6 and sched.num_unreported_tokens == 4


def _rows_run(engine: LLMEngine, tag: str, wire: bool) -> list[list[tuple]]:
    """Streamed delta requests (text, logprobs, n = 2, a stop string), every step's outputs in
    wire form: ``step_rows()``, or ``step()`` packed by ``pack_outputs``. Timestamps dropped."""
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 7 * i)] for i in range(6)]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0, max_tokens=8 + 5 * i, logprobs=2 if i == 1 else None
        )
        if i == 3:
            params = SamplingParams(temperature=0.0, max_tokens=20, n=2, seed=5)
        if i == 5:
            params = SamplingParams(temperature=0.0, max_tokens=30, stop=["a"])
        engine.add_request(f"{tag}{i}", prompt, params, stream=True, delta=True)
    steps = []
    while engine.has_unfinished_requests():
        rows = engine.step_rows() if wire else pack_outputs(engine.step())
        steps.append(
            [
                (rid.removeprefix(tag), fin, comps, m[5:], cached, err, plp)
                for rid, fin, comps, m, cached, err, plp in rows
            ]
        )
    return steps


def test_wire_rows_match_packed_outputs(tmp_path) -> None:
    engine = _engine(tmp_path, True)
    packed = _rows_run(engine, "p", wire=False)
    assert engine.kv_manager.reset_prefix_cache()  # the same cache hits both times
    wire = _rows_run(engine, "w", wire=True)
    assert wire == packed and len(wire) > 10
    assert any(comps[0][4] for step in wire for _, _, comps, *_ in step)  # logprobs went through
