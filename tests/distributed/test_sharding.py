"""The sharded loader and the slicing rules, in-process (no workers): every rank's slices of a
safetensors checkpoint, read with ``get_slice``, put back together give the checkpoint; KV heads
replicate when there are fewer than ranks; quantized canonical layouts split by whole groups."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from roofline.config import ModelConfig
from roofline.distributed.loader import iter_sharded_weights
from roofline.distributed.sharding import ShardLayout, check_shardable
from roofline.models.weights import resolve_model

CFG = ModelConfig.from_dict(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 30,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
    }
)


def _checkpoint(tmp_path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": torch.randn(30, 16, generator=g),
        p + "self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        p + "self_attn.q_proj.bias": torch.randn(16, generator=g),
        p + "self_attn.k_proj.weight": torch.randn(8, 16, generator=g),
        p + "self_attn.v_proj.weight": torch.randn(8, 16, generator=g),
        p + "self_attn.o_proj.weight": torch.randn(16, 16, generator=g),
        p + "mlp.gate_proj.weight": torch.randn(24, 16, generator=g),
        p + "mlp.down_proj.weight": torch.randn(16, 24, generator=g),
        p + "input_layernorm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(30, 16, generator=g),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return tensors


@pytest.mark.parametrize("world_size", [2, 4])
def test_slices_reassemble_the_checkpoint(tmp_path, world_size):
    full = _checkpoint(tmp_path)
    source = resolve_model(str(tmp_path))
    ranks = [
        dict(iter_sharded_weights(source, CFG, ShardLayout.of(CFG, r, world_size)))
        for r in range(world_size)
    ]
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        if "layernorm" in name:
            assert all(torch.equal(p, tensor) for p in parts)
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif ("k_proj" in name or "v_proj" in name) and world_size == 4:  # 2 KV heads: replicated
            assert [
                torch.equal(p, tensor[(r // 2) * 4 : (r // 2 + 1) * 4]) for r, p in enumerate(parts)
            ] == [True] * 4
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            per = -(-30 // world_size)
            assert all(p.shape == (per, 16) for p in parts)  # last rank padded with zeros
            assert torch.equal(torch.cat(parts)[:30], tensor)
            assert not torch.cat(parts)[30:].any()
        else:
            assert torch.equal(torch.cat(parts, dim=0), tensor), name


def test_quantized_row_parallel_slices_keep_whole_groups():
    layout = ShardLayout.of(CFG, 1, 2)
    # down_proj K = 24: int4 qweight [N, K // 2], scales [N, K // group] (group 6) -> 4 groups
    qweight = layout.slice_of("model.layers.0.mlp.down_proj.qweight", (16, 12), 4)
    scales = layout.slice_of("model.layers.0.mlp.down_proj.scales", (16, 4), 4)
    assert (qweight.dim, qweight.start, qweight.length) == (1, 6, 6)
    assert (scales.dim, scales.start, scales.length) == (1, 2, 2)
    assert layout.slice_of("model.layers.0.mlp.down_proj.scales", (16, 1), 4) is None
    with pytest.raises(ValueError, match="straddle"):
        layout.slice_of("model.layers.0.mlp.down_proj.scales", (16, 3), 4)
    col = layout.slice_of("model.layers.0.mlp.gate_proj.scales", (24, 2), 4)
    assert (col.dim, col.start, col.length) == (0, 12, 12)


def test_unshardable_configs_are_refused():
    with pytest.raises(ValueError, match="attention heads"):
        check_shardable(CFG, 3)
    cfg = ModelConfig.from_dict({**CFG.hf_config, "num_key_value_heads": 4, "head_dim": 4})
    check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_shardable(ModelConfig.from_dict({**CFG.hf_config, "intermediate_size": 26}), 4)


def test_a_method_that_slices_its_own_tensors_is_asked(tmp_path):
    """The quantization seam: a method overriding ``shard_slice`` gets the whole checkpoint
    tensor and the slice in unquantized weight elements; other layers are cut by the loader."""
    from roofline.quantization.base import QuantizationConfig, UnquantizedLinearMethod

    calls = []

    class Packed(UnquantizedLinearMethod):
        def shard_slice(self, name, tensor, axis, start, size):
            calls.append((name, tuple(tensor.shape), axis, start, size))
            return super().shard_slice(name, tensor, axis, start, size)

    class OnlyDown(QuantizationConfig):
        def get_linear_method(self, prefix):
            return Packed() if prefix.endswith("down_proj") else UnquantizedLinearMethod()

    full = _checkpoint(tmp_path)
    source = resolve_model(str(tmp_path))
    got = dict(iter_sharded_weights(source, CFG, ShardLayout.of(CFG, 1, 2), OnlyDown()))
    assert calls == [("weight", (16, 24), "in", 12, 12)]
    assert torch.equal(
        got["model.layers.0.mlp.down_proj.weight"],
        full["model.layers.0.mlp.down_proj.weight"][:, 12:],
    )
