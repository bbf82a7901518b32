"""Our layers against HF transformers' own Llama modules, bit for bit (``torch.equal``), in fp32,
bf16 and fp16: ``LlamaRMSNorm`` (and the residual add before it), ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb`` (default, linear and llama3 RoPE), the MLP's ``act_fn(gate) * up``, the
whole ``LlamaMLP`` and the packed q/k/v projection. On the CPU our layers take their torch paths;
on CUDA the same tests run our Triton kernels against HF on the GPU (the bf16 greedy-parity target
depends on both).

RMSNorm inputs are multiples of 1/16, so sums of squares are exact in any order: the tests then
pin the rounding points, not the summation order (which no kernel shares with torch's reduction).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama import modeling_llama as hf

from roofline.config import ModelConfig
from roofline.layers.activation import SiluAndMul
from roofline.layers.linear import MergedLinear
from roofline.layers.norm import RMSNorm
from roofline.layers.rotary import RotaryEmbedding, rope_inv_freq
from roofline.models.llama import LlamaMLP

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M's shapes
ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _hf_config(scaling: dict | None = None) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=scaling,
    )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_llama_rms_norm(device: str, dtype: torch.dtype) -> None:
    gen = _gen(0)
    x = (torch.randint(-48, 49, (17, HIDDEN), generator=gen) / 16).to(dtype).to(device)
    residual = (torch.randint(-48, 49, (17, HIDDEN), generator=gen) / 16).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(dtype).to(device)
    theirs = hf.LlamaRMSNorm(HIDDEN, eps=1e-5).to(device=device, dtype=dtype)
    ours = RMSNorm(HIDDEN, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        # HF's decoder layer: hidden_states = residual + hidden_states, then the norm.
        hf_residual = residual + x
        out, new_residual = ours(x, residual)
        assert torch.equal(new_residual, hf_residual)
        assert torch.equal(out, theirs(hf_residual))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_rotary_matches_apply_rotary_pos_emb(device: str, dtype: torch.dtype, rope: str) -> None:
    scaling = ROPE_SCALINGS[rope]
    cfg = _hf_config(scaling)
    theirs = hf.LlamaRotaryEmbedding(cfg).to(device)  # inv_freq computed on the CPU, as loaded
    ours = RotaryEmbedding(HEAD_DIM, 1024, 100000.0, scaling).to(device)
    ours.reset_cache()  # on the device, like the model runner
    assert torch.equal(rope_inv_freq(HEAD_DIM, 100000.0, scaling), theirs.inv_freq.cpu())

    gen = _gen(1)
    num_tokens = 23
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen).to(device)
    q = (8 * torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)).to(dtype).to(device)
    k = (8 * torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)).to(dtype).to(device)
    with torch.no_grad():
        cos32, sin32 = theirs(q.float(), positions[None])  # fp32 [1, T, D]
        half = HEAD_DIM // 2
        table = ours.cos_sin_cache[positions]  # [T, D]
        assert torch.equal(table[:, :half], cos32[0, :, :half])
        assert torch.equal(table[:, half:], sin32[0, :, :half])

        cos, sin = theirs(q, positions[None])  # cast to q's dtype, [1, T, D]
        q_hf, k_hf = hf.apply_rotary_pos_emb(  # HF layout [batch, heads, tokens, head_dim]
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
        )
        q_ours, k_ours = ours(positions, q.clone(), k.clone())  # CUDA path rotates in place
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_hf_act_times_up(device: str, dtype: torch.dtype) -> None:
    gen = _gen(2)
    gate_up = (3 * torch.randn(31, 2 * INTERMEDIATE, generator=gen)).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    assert torch.equal(SiluAndMul()(gate_up), expected)


# CPU only: on the H100 (cuBLAS, bf16, 10 tokens) the packed GEMM's bits differ from the
# separate ones' (measured 2026-11-22): cuBLAS picks its kernel by the matrix width. That is a
# known source of bf16 divergence from HF on the GPU, recorded in BENCHMARKS.md, not a bug.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 10, 37])
@pytest.mark.parametrize("device", ["cpu"])
def test_packed_qkv_matches_separate_projections(
    device: str, dtype: torch.dtype, num_tokens: int
) -> None:
    """One GEMM on [W_q; W_k; W_v] must give HF's three GEMMs' bits. A failure on CUDA only is
    cuBLAS picking another kernel (summation order) for the wider matrix: then the packing, not
    a layer, is a source of bf16 parity loss."""
    gen = _gen(5)
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    weights = [(0.05 * torch.randn(n, HIDDEN, generator=gen)).to(dtype).to(device) for n in sizes]
    ours = MergedLinear(HIDDEN, sizes).to(device=device, dtype=dtype)
    with torch.no_grad():
        for shard, w in enumerate(weights):
            ours.load_shard(shard, w, is_bias=False)
        x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype).to(device)
        packed = ours(x).split(sizes, dim=-1)
        for got, w in zip(packed, weights):
            assert torch.equal(got, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 10, 37])
def test_mlp_matches_llama_mlp(device: str, dtype: torch.dtype, num_tokens: int) -> None:
    """Also covers the packed gate/up GEMM: one matmul on [gate; up] must give the two separate
    matmuls' bits. (On CUDA a mismatch here with the activation test passing points at cuBLAS
    choosing a different kernel for the wider fused GEMM.)"""
    cfg = _hf_config()
    torch.manual_seed(3)
    theirs = hf.LlamaMLP(cfg).to(device=device, dtype=dtype)
    ours = LlamaMLP(ModelConfig.from_dict(cfg.to_dict())).to(device=device, dtype=dtype)
    with torch.no_grad():
        ours.gate_up_proj.load_shard(0, theirs.gate_proj.weight, is_bias=False)
        ours.gate_up_proj.load_shard(1, theirs.up_proj.weight, is_bias=False)
        ours.down_proj.weight.copy_(theirs.down_proj.weight)
        x = torch.randn(num_tokens, HIDDEN, generator=_gen(4)).to(dtype).to(device)
        assert torch.equal(ours(x), theirs(x))
