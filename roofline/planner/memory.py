"""Memory arithmetic: parameter counts, weight bytes per precision, KV cache bytes, capacity.

Everything here is exact counting over the model's dimensions, in bytes. Weight precision applies
to the linear layers of the transformer blocks (the tensors quantization methods replace);
embeddings, the LM head, norms and biases stay in 16-bit (32-bit in an fp32 model), as
GPTQ/AWQ/FP8 checkpoints keep them.
int4 weights carry one fp16 scale per ``quant_group_size`` weights. KV layouts cover MHA, GQA and
MQA (from a :class:`ModelConfig`) and DeepSeek-style MLA (latent ``kv_lora_rank`` plus the
decoupled RoPE key, given explicitly). :func:`plan_memory` splits a GPU's usable memory into
weights, an activation reserve and a paged KV pool, and answers how many sequences fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec, canonical_dtype, dtype_bytes

KV_SCALE_BYTES = 4
"""One fp32 scale per quantized (fp8 / int8) K or V head and token, as the engine stores it."""


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a decoder-only transformer, grouped by how inference reads them."""

    num_layers: int
    linear_per_layer: float
    """q, k, v, o, gate, up, down weight elements of one block (MoE: the mean over the blocks of
    the experts counted, plus the router)."""
    other_per_layer: int
    """Norm weights and biases of one block (kept in 16-bit)."""
    embedding: int
    lm_head: int
    """Elements of the output projection (equal to ``embedding`` when tied, but stored once)."""
    final_norm: int
    tied: bool

    @property
    def linear(self) -> int:
        return self.num_layers * self.linear_per_layer

    @property
    def total(self) -> int:
        head = 0 if self.tied else self.lm_head
        return (
            self.num_layers * (self.linear_per_layer + self.other_per_layer)
            + self.embedding
            + head
            + self.final_norm
        )


def param_counts(model: ModelConfig, experts_per_layer: float | None = None) -> ParamCounts:
    """Exact counts; for an MoE model the linear layers hold ``experts_per_layer`` experts per
    MoE layer (default all; ``num_experts_per_tok`` gives the active parameters of a token)."""
    h, i = model.hidden_size, model.intermediate_size
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    linear: float = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * i
    if model.num_experts:
        experts = model.num_experts if experts_per_layer is None else experts_per_layer
        sparse = 3 * h * model.moe_intermediate_size * experts + h * model.num_experts  # + router
        num_dense = len(model.dense_mlp_layers)
        num_sparse = model.num_hidden_layers - num_dense
        mlp = (num_dense * 3 * h * i + num_sparse * sparse) / model.num_hidden_layers
        linear = h * (q_dim + 2 * kv_dim) + q_dim * h + mlp
        if linear == int(linear):
            linear = int(linear)
    other = 2 * h
    if model.attention_bias:
        other += q_dim + 2 * kv_dim
    if model.qk_norm:
        other += 2 * model.head_dim
    return ParamCounts(
        num_layers=model.num_hidden_layers,
        linear_per_layer=linear,
        other_per_layer=other,
        embedding=model.vocab_size * h,
        lm_head=model.vocab_size * h,
        final_norm=h,
        tied=model.tie_word_embeddings,
    )


def weight_bytes_per_param(weight_dtype: str, quant_group_size: int = 128) -> float:
    """Storage bytes per linear-layer weight, including int4 group scales (fp16 each)."""
    dt = canonical_dtype(weight_dtype)
    if dt == "int4":
        return 0.5 + 2.0 / quant_group_size
    return dtype_bytes(dt)


def other_bytes_per_param(weight_dtype: str) -> float:
    """Bytes of the parameters quantization leaves alone (embeddings, head, norms, biases)."""
    return 4.0 if canonical_dtype(weight_dtype) == "fp32" else 2.0


@dataclass(frozen=True)
class WeightBytes:
    linear: float
    other: float
    """Norms and biases of all blocks plus the final norm."""
    embedding: float
    lm_head: float
    """Zero in memory when tied (the embedding is the head); see ``lm_head_read``."""
    lm_head_read: float
    """Bytes the LM head GEMM reads each step, tied or not."""

    @property
    def total(self) -> float:
        return self.linear + self.other + self.embedding + self.lm_head


def weight_bytes(
    model: ModelConfig,
    weight_dtype: str = "bf16",
    quant_group_size: int = 128,
    tp: int = 1,
    experts_per_layer: float | None = None,
) -> WeightBytes:
    """Weight memory of one tensor-parallel rank (linear layers and vocab sharded, norms copied);
    for an MoE model, of ``experts_per_layer`` experts per MoE layer (default all)."""
    pc = param_counts(model, experts_per_layer)
    wb = weight_bytes_per_param(weight_dtype, quant_group_size)
    ob = other_bytes_per_param(weight_dtype)
    head = pc.lm_head * ob / tp
    return WeightBytes(
        linear=pc.linear * wb / tp,
        other=(pc.num_layers * pc.other_per_layer + pc.final_norm) * ob,
        embedding=pc.embedding * ob / tp,
        lm_head=0.0 if pc.tied else head,
        lm_head_read=head,
    )


@dataclass(frozen=True)
class KVLayout:
    """What one token stores per layer: K and V heads, or an MLA latent plus a RoPE key."""

    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    num_query_heads: int = 0
    kv_lora_rank: int = 0
    """MLA only: width of the compressed KV latent (512 in DeepSeek-V2/V3)."""
    qk_rope_head_dim: int = 0
    """MLA only: width of the decoupled RoPE key shared by all heads (64 in DeepSeek-V2/V3)."""

    @classmethod
    def from_model(cls, model: ModelConfig) -> KVLayout:
        return cls(
            num_layers=model.num_hidden_layers,
            num_kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            num_query_heads=model.num_attention_heads,
        )

    @classmethod
    def mla(
        cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, num_query_heads: int = 0
    ) -> KVLayout:
        if kv_lora_rank <= 0 or qk_rope_head_dim < 0:
            raise ValueError("MLA needs kv_lora_rank > 0 and qk_rope_head_dim >= 0")
        return cls(
            num_layers=num_layers,
            num_query_heads=num_query_heads,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        if self.num_query_heads and self.num_kv_heads < self.num_query_heads:
            return f"GQA-{self.num_kv_heads}"
        return "MHA"

    def elements_per_token_per_layer(self, tp: int = 1) -> int:
        """Elements one rank stores per token and layer. KV heads are sharded across ``tp``
        ranks and replicated when there are fewer heads than ranks; the MLA latent is
        replicated on every rank."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * math.ceil(self.num_kv_heads / tp) * self.head_dim


def weight_bytes_per_gpu(
    model: ModelConfig,
    weight_dtype: str = "bf16",
    quant_group_size: int = 128,
    tp: int = 1,
    pp: int = 1,
) -> float:
    """Weights on the fullest GPU of a ``tp`` x ``pp`` grid: ``ceil(layers / pp)`` blocks,
    sharded ``tp`` ways, plus the larger of the embedding (first stage) and the LM head (last
    stage, its own copy when tied); the final norm's few bytes are left out."""
    wb = weight_bytes(model, weight_dtype, quant_group_size, tp)
    if pp == 1:
        return wb.total
    pc = param_counts(model)
    per_layer = wb.linear / pc.num_layers + pc.other_per_layer * other_bytes_per_param(weight_dtype)
    blocks = math.ceil(pc.num_layers / pp) * per_layer
    # A tied head needs its own copy on the last stage: count the bytes it reads.
    return blocks + max(wb.embedding, wb.lm_head_read)


def kv_bytes_per_token(layout: KVLayout, kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> float:
    """KV bytes of one token over the layers one rank holds (all layers when ``pp`` is 1).
    fp8 / int8 K/V heads carry one fp32 scale each, as the engine stores them
    (``roofline/quantization/kv_cache.py``)."""
    layers = math.ceil(layout.num_layers / pp)
    elements = layout.elements_per_token_per_layer(tp)
    scales = 0
    if canonical_dtype(kv_dtype) in ("fp8", "int8") and not layout.is_mla:
        scales = KV_SCALE_BYTES * elements // layout.head_dim
    return layers * (elements * dtype_bytes(kv_dtype) + scales)


def kv_bytes(
    layout: KVLayout,
    num_tokens: int,
    kv_dtype: str = "bf16",
    batch_size: int = 1,
    page_size: int | None = None,
    tp: int = 1,
) -> float:
    """KV bytes of ``batch_size`` sequences of ``num_tokens`` each; with ``page_size`` each
    sequence is rounded up to whole pages, as the paged pool allocates it."""
    tokens = num_tokens if page_size is None else math.ceil(num_tokens / page_size) * page_size
    return kv_bytes_per_token(layout, kv_dtype, tp) * tokens * batch_size


def activation_reserve_bytes(
    model: ModelConfig, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, tp: int = 1
) -> float:
    """Peak transient memory of one forward pass: the widest per-token intermediates (bf16)
    of a full token budget, plus fp32 logits for every sequence that samples."""
    q_kv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = (2 * model.intermediate_size + q_kv) / tp + 4 * model.hidden_size
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4.0
    return max_num_batched_tokens * per_token * 2.0 + logits


@dataclass(frozen=True)
class MemoryPlan:
    """How one GPU's memory splits, and what the KV pool holds at ``context_len``."""

    gpu_memory_bytes: float
    usable_bytes: float
    weight_bytes: float
    reserve_bytes: float
    kv_pool_bytes: float
    kv_bytes_per_token: float
    page_size: int
    num_pages: int
    context_len: int
    max_num_seqs: int
    """Sequences of ``context_len`` tokens whose pages fit the pool at once."""

    @property
    def kv_bytes_per_seq(self) -> float:
        pages = math.ceil(self.context_len / self.page_size)
        return pages * self.page_size * self.kv_bytes_per_token

    @property
    def max_num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def fits(self) -> bool:
        return self.kv_pool_bytes > 0 and self.max_num_seqs > 0


def plan_memory(
    model: ModelConfig,
    gpu: GPUSpec,
    context_len: int,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float | None = None,
    page_size: int = 16,
    tp: int = 1,
    pp: int = 1,
    kv_layout: KVLayout | None = None,
    quant_group_size: int = 128,
) -> MemoryPlan:
    """Usable memory = total x utilisation; KV pool = usable - weights - reserve, on the
    fullest rank of a ``tp`` x ``pp`` grid."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")
    if context_len <= 0 or page_size <= 0:
        raise ValueError("context_len and page_size must be positive")
    layout = kv_layout or KVLayout.from_model(model)
    usable = gpu.memory_bytes * gpu_memory_utilization
    weights = weight_bytes_per_gpu(model, weight_dtype, quant_group_size, tp, pp)
    reserve = activation_reserve_bytes(model, tp=tp) if reserve_bytes is None else reserve_bytes
    pool = max(0.0, usable - weights - reserve)
    per_token = kv_bytes_per_token(layout, kv_dtype, tp, pp)
    num_pages = int(pool // (per_token * page_size))
    pages_per_seq = math.ceil(context_len / page_size)
    return MemoryPlan(
        gpu_memory_bytes=gpu.memory_bytes,
        usable_bytes=usable,
        weight_bytes=weights,
        reserve_bytes=reserve,
        kv_pool_bytes=pool,
        kv_bytes_per_token=per_token,
        page_size=page_size,
        num_pages=num_pages,
        context_len=context_len,
        max_num_seqs=num_pages // pages_per_seq,
    )


def max_context_len_for_batch(plan: MemoryPlan, batch_size: int) -> int:
    """Longest context (whole pages) each of ``batch_size`` sequences can hold at once."""
    if batch_size <= 0:
        raise ValueError("batch_size must be positive")
    return (plan.num_pages // batch_size) * plan.page_size
