"""Frozen configuration dataclasses, one per concern.

Each field documents its meaning and units; the CLI help text is taken from these docstrings.
Values derived at run time (the number of KV pages that fit the memory budget, EOS ids read
from a tokenizer) are never written back here: they live on the objects that derive them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, read from an HF ``config.json`` (or GGUF metadata)."""

    architecture: str
    """HF ``architectures[0]`` name, the key of the model registry (e.g. ``LlamaForCausalLM``)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than ``num_attention_heads`` means GQA; 1 means MQA."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF ``rope_scaling`` dict (``rope_type`` ``llama3``, ``linear`` ...) or None."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model). HF ``num_experts`` (Qwen3-MoE) or
    ``num_local_experts`` (Mixtral)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Hidden width of one expert's MLP (Mixtral: ``intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to one (Mixtral always does)."""
    dense_mlp_layers: tuple[int, ...] = ()
    """Layers of an MoE model that keep a dense MLP of ``intermediate_size`` (Qwen3-MoE
    ``mlp_only_layers`` and layers off ``decoder_sparse_step``)."""
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    """dtype the checkpoint was saved in (``bfloat16``, ``float16``, ``float32``)."""
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The raw dict this config was made from (handed to HF transformers for parity tests)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        arch = archs[0]
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers >= 5 nests RoPE settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        moe_inter = int(d.get("moe_intermediate_size") or d["intermediate_size"])
        if arch == "MixtralForCausalLM":  # its intermediate_size is the experts' width
            moe_inter = int(d["intermediate_size"])
        dense_layers: tuple[int, ...] = ()
        if num_experts:
            step = int(d.get("decoder_sparse_step") or 1)
            only = set(d.get("mlp_only_layers") or ())
            dense_layers = tuple(
                i for i in range(int(d["num_hidden_layers"])) if i in only or (i + 1) % step != 0
            )
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=moe_inter if num_experts else 0,
            # Mixtral always renormalises; HF's Qwen3-MoE default is not to
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(d.get("norm_topk_prob", False)),
            dense_mlp_layers=dense_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=str(dtype),
            hf_config=dict(d),
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ModelConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def num_params(self, experts_counted: int | None = None) -> int:
        """Parameter count (embeddings and LM head counted once each; once if tied); for an MoE
        model, ``experts_counted`` experts per MoE layer (default: all of them)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, kv * self.head_dim
        attn = h * (q_dim + 2 * kv_dim) + q_dim * h
        if self.attention_bias:
            attn += q_dim + 2 * kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 2 * h
        mlp = self.num_hidden_layers * 3 * h * i
        if self.num_experts:
            num_moe = self.num_hidden_layers - len(self.dense_mlp_layers)
            expert = 3 * h * self.moe_intermediate_size
            mlp = len(self.dense_mlp_layers) * 3 * h * i
            mlp += num_moe * (experts_counted or self.num_experts) * expert
            mlp += num_moe * h * self.num_experts  # routers
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * layer + mlp + embed + head + h

    def num_active_params(self) -> int:
        """Parameters one token reads: ``num_params`` with top-k experts per MoE layer."""
        return self.num_params(experts_counted=self.num_experts_per_tok or None)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    page_size: int = 16
    """Tokens per KV page."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV pool. When None, ``gpu_memory_utilization`` sizes it on CUDA and a
    fixed 1 GiB budget is used on the CPU."""
    gpu_memory_utilization: float = 0.9
    """Fraction of total GPU memory the engine may use (weights + activations + KV pool)."""
    enable_prefix_caching: bool = True
    """Reuse KV pages of identical prompt prefixes (full pages, hash-chained, LRU eviction)."""
    num_pages_override: int | None = None
    """Exact number of KV pages (tests use this to force preemption)."""
    kv_cache_dtype: str = "auto"
    """Page storage: ``auto`` (the model's dtype), ``fp8`` (e4m3) or ``int8``, the last two
    with a per-token, per-head scale (``roofline/quantization/kv_cache.py``)."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_pages_override is not None and self.num_pages_override <= 0:
            raise ValueError("num_pages_override must be positive")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(
                f"kv_cache_dtype must be auto, fp8 or int8, got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits and policy."""

    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes together)."""
    max_model_len: int = 4096
    """Longest context (prompt + output) a request may reach."""
    policy: str = "fcfs"
    """``fcfs`` (arrival order) or ``priority`` (lower value first, then arrival)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep running beside them."""
    max_num_waiting: int | None = None
    """Admission limit on queued requests (None = unbounded); the server answers 429 past it."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
