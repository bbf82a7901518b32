"""MoE checkpoints: per-expert safetensors (HF's saved layout) and GGUF's stacked ``*_exps``
tensors load into the same stacked parameters; the config fields come from both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from roofline.config import ModelConfig
from roofline.models.registry import get_model_class
from roofline.models.weights import iter_weights, load_model_config, resolve_model
from tests.e2e.hf_reference import tiny_hf_model
from tests.models.test_weights import _interleave_rope_rows, _to_gguf_name


def _write_moe_gguf(path: Path, arch: str, model) -> None:
    c = model.config
    num_experts = getattr(c, "num_experts", None) or c.num_local_experts
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_expert_feed_forward_length(inter)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(0)  # ALL_F32
    writer.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp.experts.gate_up_proj" in name:  # transformers 5 keeps [E, 2I, H] in memory
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", array[:, :inter].copy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", array[:, inter:].copy())
            continue
        if ".mlp.experts.down_proj" in name:
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", array)
            continue
        if ".mlp.gate.weight" in name:
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", array)
            continue
        if arch == "llama" and ".q_proj." in name:
            array = _interleave_rope_rows(array, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            array = _interleave_rope_rows(array, c.num_key_value_heads)
        writer.add_tensor(_to_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load(path: Path):
    source = resolve_model(path)
    cfg = load_model_config(source)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, 64)
    model = model.to_empty(device="cpu")
    model.load_weights(iter_weights(source))
    return cfg, model


@pytest.mark.parametrize(
    ("hf_name", "gguf_arch", "arch"),
    [("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM"), ("mixtral", "llama", "MixtralForCausalLM")],
)
def test_moe_safetensors_and_gguf_agree(tmp_path: Path, hf_name, gguf_arch, arch) -> None:
    hf = tiny_hf_model(hf_name, tmp_path / "hf", num_hidden_layers=2, mlp_only_layers=[])
    _write_moe_gguf(tmp_path / "m.gguf", gguf_arch, hf)
    cfg_st, from_st = _load(tmp_path / "hf")
    cfg_gg, from_gg = _load(tmp_path / "m.gguf")
    for cfg in (cfg_st, cfg_gg):
        assert cfg.architecture == arch and cfg.norm_topk_prob
        assert (cfg.num_experts, cfg.num_experts_per_tok) == ((8, 2) if arch[0] == "Q" else (4, 2))
        assert cfg.moe_intermediate_size == (48 if arch[0] == "Q" else 160)
    layer = from_st.layers[1].mlp
    hf_experts = hf.model.layers[1].mlp.experts
    assert torch.equal(layer.w13_weight, hf_experts.gate_up_proj)
    assert torch.equal(layer.w2_weight, hf_experts.down_proj)
    params_gg = dict(from_gg.named_parameters())
    for name, param in from_st.named_parameters():
        assert torch.equal(param, params_gg[name]), name


def test_moe_config_dense_layers_and_missing_experts(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3_moe", tmp_path, decoder_sparse_step=2, mlp_only_layers=[])
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    assert cfg.dense_mlp_layers == (0, 2)  # layers 1 (and 3, 5, ...) are sparse
    assert cfg.num_active_params() < cfg.num_params()
    del hf
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, 64)
    model = model.to_empty(device="cpu")
    weights = [(n, t) for n, t in iter_weights(resolve_model(tmp_path)) if "experts.3.up" not in n]
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.mlp\.experts\.3\.up"):
        model.load_weights(weights)
