"""Start-up warm-up: every kernel specialization a serving step needs is compiled before the
first request (on CUDA, where Triton compiles), and the warm-up's mixed batches run on any
device; the engine's step timing and the JIT-compile counter the benchmarks report."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.kernels import count_jit_compiles
from tests.e2e.hf_reference import tiny_hf_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm")
    tiny_hf_model("llama", path, head_dim=32, hidden_size=128, num_attention_heads=4)
    return path


def _varied_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 200))] for _ in range(n)]


def test_mixed_warmup_batches_run_on_cpu(tiny_path):
    llm = LLM(str(tiny_path), dtype="float32", device="cpu", max_model_len=256)
    runner = llm.llm_engine.runner
    for q in (16, 33, 128):  # a chunk over a cached prefix, decode rows, a short prefill
        runner._warmup_forward([(16, q), (40, 1), (0, 3), (20, 1)])
    # the pages the warm-up wrote belong to nobody: generation is unaffected
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(_varied_prompts(4, 1), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_step_timing_counts_steps(tiny_path):
    llm = LLM(str(tiny_path), dtype="float32", device="cpu", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate(_varied_prompts(3, 2), params, use_tqdm=False)
    t = llm.llm_engine.step_timing
    assert t.steps >= 5 and t.total_s > 0.0
    assert 0.0 <= t.wait_s <= t.total_s and 0.0 <= t.host_fraction <= 1.0
    later = llm.llm_engine.step_timing
    assert later.since(t).steps == 0


def test_generate_runs_its_steps_on_a_frozen_heap(tiny_path):
    """LLM.generate keeps the objects that existed before it out of the GC's full collections
    while it steps, then hands them back; a heap someone else froze is left frozen."""
    llm = LLM(str(tiny_path), dtype="float32", device="cpu", max_model_len=256)
    frozen: list[int] = []
    llm.llm_engine.on_schedule = lambda _: frozen.append(gc.get_freeze_count())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert gc.get_freeze_count() == 0
    llm.generate(_varied_prompts(2, 3), params, use_tqdm=False)
    assert len(frozen) >= 4 and min(frozen) > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        llm.generate(_varied_prompts(2, 4), params, use_tqdm=False)
        assert gc.get_freeze_count() > 0  # still frozen (unfreeze() would make it 0)
    finally:
        gc.unfreeze()


def test_count_jit_compiles_chains_and_restores():
    knobs = pytest.importorskip("triton").knobs
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].name)
        return False

    knobs.runtime.jit_post_compile_hook = previous
    try:

        class Info:
            name = "_some_kernel"

        with count_jit_compiles() as names:
            knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=Info())
        assert names == ["_some_kernel"] and seen == ["_some_kernel"]
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_no_kernel_compiles_after_startup(tiny_path, dtype):
    llm = LLM(
        str(tiny_path),
        dtype=dtype,
        device="cuda",
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=512,
        max_num_seqs=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with count_jit_compiles() as names:
        # varied prompt lengths and counts: chunked prefill, mixed steps, many batch widths
        llm.generate(_varied_prompts(70, 3), params, use_tqdm=False)
        llm.generate(_varied_prompts(5, 4), params, use_tqdm=False)
    assert names == []
