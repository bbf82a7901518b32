"""EngineArgs: resolution of auto values against the model and refusal of bad settings."""

from __future__ import annotations

import pytest
import torch

from roofline.config import ModelConfig
from roofline.engine.args import EngineArgs

BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)


def _cfg(**extra) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **extra})


def test_sliding_window_caps_the_context():
    cfg = _cfg(architectures=["MistralForCausalLM"], sliding_window=4096)
    sc = EngineArgs().scheduler_config(cfg, torch.device("cpu"))
    assert sc.max_model_len == 4096
    with pytest.raises(ValueError, match="sliding window"):
        EngineArgs(max_model_len=8192).scheduler_config(cfg, torch.device("cpu"))
    # Qwen2 configs carry a window they do not use
    qwen = _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=False)
    assert EngineArgs().scheduler_config(qwen, torch.device("cpu")).max_model_len == 8192


def test_max_model_len_above_the_model_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineArgs(max_model_len=65536).scheduler_config(_cfg(), torch.device("cpu"))


def test_dtype_resolution():
    cfg = _cfg(torch_dtype="bfloat16")
    assert EngineArgs().resolve_dtype(cfg, torch.device("cpu")) == torch.float32
    assert EngineArgs().resolve_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    assert EngineArgs(dtype="fp16").resolve_dtype(cfg, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="int3").resolve_dtype(cfg, torch.device("cpu"))
