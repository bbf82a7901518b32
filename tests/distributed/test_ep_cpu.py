"""Expert parallelism on the CPU with gloo, 2 ranks: greedy tokens of tiny random Qwen3-MoE (8
experts, top-2, one dense layer) and Mixtral (4 experts, top-2) checkpoints identical (fp32) to
a single process, with attention tensor-parallel and the experts placed whole (each rank reads
only its experts' tensors), with chunked prefill, prefix caching and preemption; once with the
default replicated dispatch, once with the all-to-all dispatch; MoE under plain tensor
parallelism (experts' columns split); the bad combinations refused before any worker starts."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 3,
    [20, 21, 22],
    [5, 6, 7, 8, 9, 10, 11] * 3 + [40, 41],
    [100 + i for i in range(30)],
]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_batched_tokens=16,
    num_pages=14,
    page_size=4,
    max_model_len=64,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (checkpoint folder, single-process greedy tokens), built on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(f"ep-{arch}")
            tiny_hf_model(arch, path, num_hidden_layers=2)
            made[arch] = path, _generate(LLM(str(path), **ENGINE))
        return made[arch]

    return get


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _check(path, expected, **kwargs) -> None:
    llm = LLM(str(path), **ENGINE, tensor_parallel_size=2, **kwargs)
    try:
        got = _generate(llm)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_parallel_matches_single_process(tiny, arch):
    path, expected = tiny(arch)
    _check(path, expected, enable_expert_parallel=True)


def test_all_to_all_dispatch_matches_single_process(tiny, monkeypatch):
    path, expected = tiny("qwen3_moe")
    monkeypatch.setenv("ROOFLINE_EP_DISPATCH", "all_to_all")  # inherited by the workers
    _check(path, expected, enable_expert_parallel=True)


def test_tensor_parallel_experts_match_single_process(tiny):
    path, expected = tiny("mixtral")
    _check(path, expected)


def test_int4_experts_under_expert_parallel_match_single_process(tiny):
    """Whole experts quantize on their rank exactly as in one process (int4 g32 also keeps the
    attention's row-parallel groups whole), so the tokens are the same."""
    path, _ = tiny("mixtral")
    expected = _generate(LLM(str(path), **ENGINE, quantization="int4-g32"))
    _check(path, expected, enable_expert_parallel=True, quantization="int4-g32")


def test_bad_expert_parallel_arguments_are_refused(tiny, tmp_path):
    path, _ = tiny("mixtral")  # 4 experts
    with pytest.raises(ValueError, match="4 experts do not split evenly over 3"):
        LLM(str(path), **ENGINE, tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="80 expert columns do not split into quantization groups"):
        LLM(str(path), **ENGINE, tensor_parallel_size=2, quantization="int4-g32")
    dense = tmp_path / "dense"
    tiny_hf_model("llama", dense, num_hidden_layers=1)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(dense), **ENGINE, enable_expert_parallel=True)
