"""Helpers that run HF transformers as the reference: greedy decoding with its own KV cache."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """Greedy tokens from an HF causal LM, one prompt at a time (no padding, no EOS stop)."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    past, tokens = out.past_key_values, []
    next_id = int(out.logits[0, -1].argmax())
    for _ in range(num_new_tokens):
        tokens.append(next_id)
        out = model(torch.tensor([[next_id]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        next_id = int(out.logits[0, -1].argmax())
    return tokens


@torch.inference_mode()
def hf_greedy_with_margins(
    model, prompt_ids: list[int], num_new_tokens: int
) -> tuple[list[int], list[float]]:
    """``hf_greedy``'s tokens and, per token, HF's gap between its top two logits (as float32):
    a near-zero gap is a near-tie that a last-bit rounding difference can flip."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    tokens, margins = [], []
    for step in range(num_new_tokens):
        top2 = out.logits[0, -1].float().topk(2)
        next_id = int(out.logits[0, -1].argmax())  # the argmax hf_greedy takes (first on ties)
        tokens.append(next_id)
        margins.append(float(top2.values[0] - top2.values[1]))
        if step + 1 < num_new_tokens:
            nxt = torch.tensor([[next_id]], device=device)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def tiny_hf_model(arch: str, tmp_path, seed: int = 0, **overrides):
    """A small random HF model of ``arch`` saved as safetensors in ``tmp_path``; returns it.

    Weights are drawn with a large std so greedy argmax has clear margins (no near-ties that
    float reassociation could flip)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        cfg = transformers.Qwen3Config(**common, rope_theta=1000000.0)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "qwen3_moe":
        common.setdefault("head_dim", 32)
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
        moe.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
        cfg = transformers.Qwen3MoeConfig(**{**moe, **common}, rope_theta=1000000.0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0
        )
        model = transformers.MixtralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    with torch.no_grad():  # biases default to zero; give them values so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model
