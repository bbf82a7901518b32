"""Shared fixtures of the planner tests: the literature's Llama-2-70B built from explicit
dimensions, and a small kept config for fast simulations."""

from __future__ import annotations

import pytest

from roofline.config import ModelConfig
from roofline.planner.models import model_from_dims, resolve_model


@pytest.fixture
def llama2_70b() -> ModelConfig:
    return model_from_dims(
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
    )


@pytest.fixture
def llama3_8b() -> ModelConfig:
    return resolve_model("llama-3.1-8b")


@pytest.fixture
def small_model() -> ModelConfig:
    return resolve_model("qwen3-0.6b")
