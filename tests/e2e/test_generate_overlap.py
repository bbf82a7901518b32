"""``LLM.generate`` launches its first step once the prompts added fill a step's token budget
(async scheduling), so the device computes it while the rest are added: the same greedy tokens
as an engine that adds everything first, the first step taken before the last add, and a bad
prompt after that step still leaves nothing queued."""

from __future__ import annotations

import random

import pytest

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", path)
    return path


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def test_first_step_overlaps_the_adds(tiny) -> None:
    prompts = _prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs, added_at_first_step = [], []
    for async_scheduling in (True, False):
        llm = LLM(str(tiny), dtype="float32", device="cpu", max_num_batched_tokens=64,
                  async_scheduling=async_scheduling)  # fmt: skip
        engine = llm.llm_engine
        first: list[int] = []

        def counted(step=engine.step, engine=engine, first=first) -> list:
            if not first:
                first.append(len(engine._groups))  # requests added when the first step ran
            return step()

        engine.step = counted
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        added_at_first_step += first
    assert runs[0] == runs[1]
    assert 0 < added_at_first_step[0] < len(prompts)  # async: stepped before every add
    assert added_at_first_step[1] == len(prompts)  # sync: everything added first


def test_a_bad_prompt_after_the_first_step_leaves_nothing(tiny) -> None:
    llm = LLM(str(tiny), dtype="float32", device="cpu", max_num_batched_tokens=32,
              async_scheduling=True)  # fmt: skip
    engine = llm.llm_engine
    prompts = _prompts(6) + [[10**9]]  # out of the vocabulary: refused after the early step
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    good = llm.generate(_prompts(3), SamplingParams(temperature=0.0, max_tokens=3))
    assert [len(o.outputs[0].token_ids) for o in good] == [3, 3, 3]
