"""Tensor and pipeline parallelism: memory per GPU and communication time.

Megatron-style tensor parallelism splits every block's attention heads and MLP columns over
``tp`` ranks and all-reduces the hidden state twice per layer (after the attention output
projection and after the MLP down projection). A ring all-reduce of ``n`` bytes over ``p`` ranks
moves ``2 (p - 1) / p * n`` bytes through each rank's link and takes ``2 (p - 1)`` latency hops
(the alpha-beta model); the engine all-reduces messages up to 256 KiB (decode) one-shot
instead, each rank reading its ``p - 1`` peers' ``n`` bytes after a signal (``(p - 1) n`` bytes
over its link, two latency terms), and both costs come from ``roofline.distributed.comm_model``,
the model the engine's transport choice follows. Pipeline parallelism splits the layers into
``pp`` stages that hand the hidden state on point to point; it cuts memory per GPU but not the
latency of one token.
"""

from __future__ import annotations

from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.distributed import comm_model
from roofline.planner.hardware import GPUSpec, dtype_bytes
from roofline.planner.memory import KVLayout, MemoryPlan, plan_memory


def ring_allreduce_time_s(num_bytes: float, num_gpus: int, gpu: GPUSpec) -> float:
    """alpha-beta time of a ring all-reduce of ``num_bytes`` over ``num_gpus`` ranks."""
    bw, hop = gpu.interconnect_bandwidth_bytes_per_s, gpu.interconnect_latency_s
    return comm_model.ring_allreduce_s(num_bytes, num_gpus, bw, hop)


def allreduce_time_s(num_bytes: float, num_gpus: int, gpu: GPUSpec) -> float:
    """The engine's all-reduce (one-shot for small messages, else ring): ``comm_model``."""
    bw, hop = gpu.interconnect_bandwidth_bytes_per_s, gpu.interconnect_latency_s
    return comm_model.allreduce_s(num_bytes, num_gpus, bw, hop)


def allreduce_bytes_per_layer(
    model: ModelConfig, num_tokens: int, act_dtype: str = "bf16"
) -> float:
    """Bytes all-reduced per layer for ``num_tokens`` tokens (two hidden-state reductions)."""
    return 2 * num_tokens * model.hidden_size * dtype_bytes(act_dtype)


def allreduce_time_per_layer_s(
    model: ModelConfig, gpu: GPUSpec, tp: int, num_tokens: int = 1, act_dtype: str = "bf16"
) -> float:
    """Both all-reduces of one layer (each a separate collective, so two latency terms)."""
    one = num_tokens * model.hidden_size * dtype_bytes(act_dtype)
    return 2 * allreduce_time_s(one, tp, gpu)


def allreduce_time_per_step_s(
    model: ModelConfig, gpu: GPUSpec, tp: int, num_tokens: int = 1, act_dtype: str = "bf16"
) -> float:
    """All-reduce time of one forward pass over ``num_tokens`` tokens (all layers)."""
    return model.num_hidden_layers * allreduce_time_per_layer_s(
        model, gpu, tp, num_tokens, act_dtype
    )


def pipeline_p2p_time_s(
    model: ModelConfig, gpu: GPUSpec, pp: int, num_tokens: int = 1, act_dtype: str = "bf16"
) -> float:
    """Time to hand ``num_tokens`` hidden states across the ``pp - 1`` stage boundaries."""
    if pp <= 1:
        return 0.0
    one = num_tokens * model.hidden_size * dtype_bytes(act_dtype)
    hop = one / gpu.interconnect_bandwidth_bytes_per_s + gpu.interconnect_latency_s
    return (pp - 1) * hop


def pipeline_bubble_fraction(pp: int, num_microbatches: int) -> float:
    """GPipe/1F1B idle fraction ``(pp - 1) / (m + pp - 1)`` for ``m`` micro-batches."""
    if pp < 1 or num_microbatches < 1:
        raise ValueError("pp and num_microbatches must be >= 1")
    return (pp - 1) / (num_microbatches + pp - 1)


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    pp: int
    memory: MemoryPlan
    """Per GPU (the fullest rank)."""
    allreduce_per_layer_s: float
    """Both all-reduces of one layer for one decode token."""
    allreduce_per_token_s: float
    """All layers, one decode token (batch 1)."""
    p2p_per_token_s: float

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def max_num_seqs_total(self) -> int:
        """Concurrent sequences of one replica (the ranks of a stage share one pool)."""
        return self.memory.max_num_seqs


def plan_parallel(
    model: ModelConfig,
    gpu: GPUSpec,
    tp: int,
    pp: int,
    context_len: int,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float | None = None,
    page_size: int = 16,
    kv_layout: KVLayout | None = None,
) -> ParallelPlan:
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be >= 1")
    if model.num_attention_heads % tp:
        raise ValueError(f"{model.num_attention_heads} attention heads do not split over tp={tp}")
    if pp > model.num_hidden_layers:
        raise ValueError(f"pp={pp} exceeds {model.num_hidden_layers} layers")
    mem = plan_memory(
        model,
        gpu,
        context_len,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        reserve_bytes=reserve_bytes,
        page_size=page_size,
        tp=tp,
        pp=pp,
        kv_layout=kv_layout,
    )
    per_layer = allreduce_time_per_layer_s(model, gpu, tp)
    return ParallelPlan(
        tp=tp,
        pp=pp,
        memory=mem,
        allreduce_per_layer_s=per_layer,
        allreduce_per_token_s=per_layer * model.num_hidden_layers,
        p2p_per_token_s=pipeline_p2p_time_s(model, gpu, pp),
    )


def min_gpus_to_fit(
    model: ModelConfig,
    gpu: GPUSpec,
    context_len: int,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    max_tp: int = 8,
) -> int | None:
    """Smallest power-of-two tensor-parallel degree whose KV pool holds one sequence of
    ``context_len`` tokens (None when even ``max_tp`` GPUs do not)."""
    tp = 1
    while tp <= max_tp:
        if model.num_attention_heads % tp == 0:
            plan = plan_memory(
                model,
                gpu,
                context_len,
                weight_dtype=weight_dtype,
                kv_dtype=kv_dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                tp=tp,
            )
            if plan.fits:
                return tp
        tp *= 2
    return None
