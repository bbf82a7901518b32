"""Tiny random Llama models quantized on the fly per method generate the same greedy tokens as
the 16-bit path running on the dequantized weights (the dequantize-then-matmul reference); the
embedded SmolLM2 GGUF kept quantized (``quantization="gguf"``) generates what the default
dequantized path does; every bad input is a ValueError before any weight loads."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.layers.linear import MergedLinear
from roofline.quantization import common
from roofline.quantization.common import dequantize
from tests.e2e.hf_reference import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [200, 8, 8, 41, 77, 12, 300]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_hf_model("llama", path)
    return path


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", ["int8", "int4-g32", "int4-asym-g32", "fp8", "fp8-w8a8"])
def test_quantized_greedy_matches_dequantized_reference(tiny, method: str, monkeypatch) -> None:
    # the torch dequantize path (the compiled CPU kernels: tests/quantization/test_cpu_kernels.py)
    monkeypatch.setattr(common, "USE_CPU_KERNELS", False)
    quant = LLM(str(tiny), dtype="float32", device="cpu", quantization=method)
    model = quant.llm_engine.runner.model
    layer = model.layers[0].mlp.gate_up_proj
    assert layer.qweight.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)
    assert model.lm_head.weight.dtype == torch.float32  # the head stays 16/32-bit
    ref = LLM(str(tiny), dtype="float32", device="cpu")
    ref_modules = dict(ref.llm_engine.runner.model.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, MergedLinear) and module.method.quantized:
                target = ref_modules[name]
                target.weight.copy_(dequantize(module.method.kind, module, torch.float32))
                target.process_weights_after_loading()
    if method != "fp8-w8a8":
        assert _tokens(quant) == _tokens(ref)
        return
    # activations are quantized too: each layer close to the dequantized-weight GEMM
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref_modules["layers.0.mlp.gate_up_proj"](x)
        err = (layer(x) - expected).norm() / expected.norm()
    assert 0 < float(err) < 0.1
    assert len(_tokens(quant)[0]) == GREEDY.max_tokens


def test_quantized_lm_head(tiny) -> None:
    llm = LLM(str(tiny), dtype="float32", device="cpu", quantization="int8", quantize_lm_head=True)
    assert llm.llm_engine.runner.model.lm_head.qweight.dtype == torch.int8
    assert len(_tokens(llm)[0]) == GREEDY.max_tokens


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(quantization="int3"), "unknown quantization"),
        (dict(quantization="int4"), "group size 128 does not divide"),  # hidden 64
        (dict(quantization="int4-g16"), "group size must be one of"),
        (dict(quantization="gptq"), "needs a checkpoint"),
        (dict(quantization="gguf"), "needs a .gguf model"),
        (dict(quantize_lm_head=True), "needs a quantization method"),
    ],
)
def test_bad_quantization_refused_before_loading(tiny, monkeypatch, kwargs, match) -> None:
    from roofline.engine import llm_engine

    def no_loading(*args, **kw):
        raise AssertionError("weights were read before the quantization was validated")

    monkeypatch.setattr(llm_engine, "iter_weights", no_loading)
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny), dtype="float32", device="cpu", **kwargs)


def test_prequantized_checkpoint_config_refusals(tiny) -> None:
    import json

    from roofline.config import ModelConfig
    from roofline.quantization.registry import resolve_quantization

    raw = json.loads((tiny / "config.json").read_text())
    cpu = torch.device("cpu")
    cases = [
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, "act-order"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "3 bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "does not divide"),
        ({"quant_method": "bitsandbytes"}, "not supported"),
    ]
    for qc, match in cases:
        cfg = ModelConfig.from_dict({**raw, "quantization_config": qc})
        with pytest.raises(ValueError, match=match):
            resolve_quantization(None, cfg, "hf", cpu)
    cfg = ModelConfig.from_dict({**raw, "quantization_config": cases[1][0]})
    with pytest.raises(ValueError, match="cannot requantize"):
        resolve_quantization("int8", cfg, "hf", cpu)


def test_gguf_kept_quantized_matches_default() -> None:
    pytest.importorskip("gguf")
    prompts = [[1, 504, 3458, 314, 260], [1, 28, 1342]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kept = LLM(device="cpu", quantization="gguf", max_model_len=256)
    model = kept.llm_engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.qweight.dtype == torch.uint8  # Q4_1 kept
    got = [o.outputs[0].token_ids for o in kept.generate(prompts, params, use_tqdm=False)]
    del kept
    default = LLM(device="cpu", max_model_len=256)
    expected = [o.outputs[0].token_ids for o in default.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_cli_flags_and_planner_precision() -> None:
    import argparse
    import json

    from roofline.config import ModelConfig
    from roofline.engine.args import EngineArgs
    from roofline.quantization.registry import resolve_quantization

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int4-asym-g64"]))
    assert args.quantization == "int4-asym-g64" and not args.quantize_lm_head
    cfg = ModelConfig.from_json("roofline/model_configs/llama-3.1-8b/config.json")
    cpu = torch.device("cpu")
    expected = {
        "int8": ("int8", "bf16", 128),
        "int4-asym-g64": ("int4", "bf16", 64),
        "fp8-w8a8": ("fp8", None, 128),
    }
    for name, precision in expected.items():
        assert resolve_quantization(name, cfg, "config", cpu).planner_precision() == precision
    checkpoints = {  # pre-quantized checkpoints: the planner reads their bytes, not 16-bit
        "gptq4-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64}, ("int4", "bf16", 64)),
        "gptq8-channel": (
            {"quant_method": "gptq", "bits": 8, "group_size": -1},
            ("int8", "bf16", 4096),
        ),
        "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, ("int4", "bf16", 128)),
    }
    raw = json.loads(open("roofline/model_configs/llama-3.1-8b/config.json").read())
    for name, (qc, precision) in checkpoints.items():
        qcfg = ModelConfig.from_dict({**raw, "quantization_config": qc})
        got = resolve_quantization(None, qcfg, "hf", cpu).planner_precision()
        assert got == precision, name


def test_quantized_warmup_rows_cover_every_gemm_bucket(tiny) -> None:
    """The CUDA warm-up's extra prefill sizes for a quantized model: the top of every row bucket
    of the wo_gemm and mixed_gemm tables past the decode sizes, up to the step's most rows (a
    bucket's kernel is compiled by any count in it); none for a 16-bit model."""
    from roofline.kernels import mixed_gemm_configs, wo_gemm_configs

    quant = LLM(str(tiny), dtype="float32", device="cpu", quantization="int8")
    rows = common.quantized_warmup_rows(quant.llm_engine.runner.model, 3000)
    assert rows == sorted(set(rows)) and rows[-1] == 3000 and rows[0] > common.DECODE_MAX_ROWS
    for m in range(common.DECODE_MAX_ROWS + 1, 3001):  # each count's buckets are warmed
        warm = min(r for r in rows if r >= m)
        assert wo_gemm_configs.m_bucket(warm) == wo_gemm_configs.m_bucket(m)
        assert mixed_gemm_configs.m_bucket(warm) == mixed_gemm_configs.m_bucket(m)
    plain = LLM(str(tiny), dtype="float32", device="cpu")
    assert common.quantized_warmup_rows(plain.llm_engine.runner.model, 3000) == []
