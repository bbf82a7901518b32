"""MoE models quantized on the fly: tiny random Qwen3-MoE and Mixtral checkpoints loaded with
``quantization="int8"`` / ``"fp8"`` quantize every expert (and the attention and dense linear
layers) and generate the same greedy tokens as the 16-bit path running on the dequantized
weights (the dequantize-then-reference loop); random (dummy) weights go through the same
method; a scheme without expert kernels is refused before any weight loads."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.kernels.fused_moe import dequantize_expert
from roofline.layers.linear import MergedLinear
from roofline.layers.moe import FusedMoE
from roofline.quantization import common
from roofline.quantization.common import dequantize
from tests.e2e.hf_reference import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [200, 8, 8, 41, 77, 12, 300, 9, 9, 14, 15, 16, 17, 18, 19, 20, 21]]
ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=8, max_model_len=64)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"q-{request.param}")
    # Qwen3-MoE experts 64 wide (Mixtral's are 160): int4 groups of 32 divide every layer
    extra = dict(moe_intermediate_size=64) if request.param == "qwen3_moe" else {}
    tiny_hf_model(request.param, path, num_hidden_layers=2, **extra)
    return path


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _dequantized_experts(block: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    quant = block.quant_tensors()
    out = []
    for which in ("w13", "w2"):
        q, s, o = (
            getattr(block, f"{which}_weight"),
            quant[f"{which}_scale"],
            quant.get(f"{which}_offset"),
        )
        out.append(torch.stack([
            dequantize_expert(q[e], s[e], None if o is None else o[e], torch.float32)
            for e in range(q.shape[0])
        ]))  # fmt: skip
    return out[0], out[1]


@pytest.mark.parametrize(
    "method,qdtype",
    [("int8", torch.int8), ("fp8", torch.float8_e4m3fn), ("int4-asym-g32", torch.uint8)],
)
def test_quantized_moe_matches_dequantized_reference(tiny_moe, method, qdtype, monkeypatch):
    monkeypatch.setattr(common, "USE_CPU_KERNELS", False)  # the linear layers' torch path
    quant = LLM(str(tiny_moe), quantization=method, **ENGINE)  # 8-token chunks of prefill
    model = quant.llm_engine.runner.model
    blocks = dict(model.moe_layers())
    assert blocks and all(b.w13_weight.dtype == qdtype for b in blocks.values())
    assert all(b.gate.weight.dtype == torch.float32 for b in blocks.values())  # the router
    ref = LLM(str(tiny_moe), **ENGINE)
    ref_model = ref.llm_engine.runner.model
    ref_modules = dict(ref_model.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, MergedLinear) and module.method.quantized:
                ref_modules[name].weight.copy_(
                    dequantize(module.method.kind, module, torch.float32)
                )
                ref_modules[name].process_weights_after_loading()
        for i, ref_block in ref_model.moe_layers():
            w13, w2 = _dequantized_experts(blocks[i])
            ref_block.w13_weight.copy_(w13)
            ref_block.w2_weight.copy_(w2)
    got, expected = _tokens(quant), _tokens(ref)
    assert got == expected
    # each quantized MoE block stays close to the 16-bit block it was made from
    plain_blocks = dict(LLM(str(tiny_moe), **ENGINE).llm_engine.runner.model.moe_layers())
    x = torch.randn(6, blocks[0].hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain_blocks[0](x)
        err = float((blocks[0](x) - want).norm() / want.norm())
    assert 0 < err < {"int8": 0.03, "fp8": 0.1}.get(method, 0.3)


def test_dummy_quantized_moe_weights(tiny_moe):
    """Random weights: experts drawn in the model dtype and quantized through the method."""
    llm = LLM(str(tiny_moe), quantization="int8", load_format="dummy", **ENGINE)
    (_, block), *_ = llm.llm_engine.runner.model.moe_layers()
    assert block.w13_weight.dtype == torch.int8
    assert float(block.w13_scale.abs().min()) > 0  # every expert row was filled
    assert float(block.w2_scale.abs().min()) > 0
    assert len(_tokens(llm)[1]) == GREEDY.max_tokens


def test_moe_quantization_without_expert_kernels_is_refused(tiny_moe, monkeypatch):
    """A scheme with no expert method (checkpoint formats), and a group that does not divide
    the experts, are ValueErrors before any weight loads."""
    from roofline.models import moe
    from roofline.quantization.registry import OnTheFlyConfig

    built = []
    monkeypatch.setattr(moe.MoeForCausalLM, "load_weights", lambda *a: built.append(a))
    monkeypatch.setattr(OnTheFlyConfig, "get_moe_method", lambda self, prefix: None)
    with pytest.raises(ValueError, match="no quantized expert kernels"):
        LLM(str(tiny_moe), quantization="int8", **ENGINE)
    monkeypatch.undo()
    monkeypatch.setattr(moe.MoeForCausalLM, "load_weights", lambda *a: built.append(a))
    with pytest.raises(ValueError, match="group size 128 does not divide"):
        LLM(str(tiny_moe), quantization="int4-g128", **ENGINE)  # hidden 64
    assert not built
