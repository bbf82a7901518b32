"""EngineArgs: the user-facing engine options, shared by ``LLM(...)`` and every CLI command.

Turns loose keyword arguments (or CLI flags) into the frozen configs, resolving ``auto`` values
(device, dtype, context length, token budget) against the model and the machine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

from roofline.config import CacheConfig, ModelConfig, SchedulerConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_HELP = {
    "dtype": "weights/activations dtype: auto (fp32 on CPU, the checkpoint's 16-bit type on GPU), "
    "float32, bfloat16, float16",
    "device": "auto (cuda when available), cpu or cuda",
    "load_format": "auto (read the weights) or dummy (random weights from the config)",
    "max_model_len": "longest context (prompt + output); default: the model's "
    "(capped at 8192 on CPU)",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": "token budget per step (default 8192 on GPU, 2048 on CPU)",
    "enable_prefix_caching": "reuse KV pages of shared prompt prefixes",
    "page_size": "tokens per KV page",
    "kv_cache_memory_bytes": "bytes for the KV pool (overrides gpu_memory_utilization)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "seed": "seed for random weights and unseeded sampling",
    "policy": "scheduling policy: fcfs or priority",
    "max_num_waiting": "refuse new requests past this many waiting (server: 429)",
    "enable_chunked_prefill": "split long prompts across steps",
    "attention_backend": "auto, torch or triton",
    "num_pages": "exact number of KV pages (testing)",
    "enforce_eager": "never capture CUDA graphs (cuda_graph_mode none)",
    "cuda_graph_mode": "full (graphs for decode-only steps and, per token-count bucket, for mixed "
    "steps, whose decode rows take the decode kernel), full_decode_only (decode graphs; mixed "
    "steps eager) or none",
    "async_scheduling": "schedule step N+1 while the GPU runs step N (default: on with CUDA)",
    "speculative_config": "speculative decoding as JSON, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\' (methods: ngram, draft_model)',
    "tensor_parallel_size": "shard the model over this many GPUs (CPU: gloo processes)",
    "distributed_executor_backend": "mp (one worker process per rank; the default above 1 "
    "rank) or ray (one actor per GPU in a placement group); unset at 1 rank: in-process",
    "enable_expert_parallel": "MoE models under tensor parallelism: place whole experts over "
    "the ranks (E / tp each; tokens dispatched to their experts' ranks) instead of splitting "
    "every expert's columns; attention stays tensor-parallel",
    "kv_cache_dtype": "KV page storage: auto (the model dtype), fp8 (e4m3) or int8, quantized "
    "per token and head (about half the bytes of bf16 pages)",
    "quantization": "weight quantization: int8, int4 (g128; int4-g32/-g64, int4-asym[-g<N>]), "
    "fp8, fp8-w8a8, or gguf (keep a GGUF's Q8_0/Q4_0/Q4_1 quantized); default: the checkpoint's "
    "own quantization_config (gptq, awq, fp8) or none",
    "quantize_lm_head": "quantize the LM head too (16-bit by default)",
    "cascade_attention": "decode steps whose rows share a long cached prefix attend it once for "
    "the group, merged with each row's own suffix (chosen when it saves enough reads; "
    "--no-cascade-attention: always the plain decode kernel)",
    "structured_outputs_backend": "grammar library for structured outputs: auto (xgrammar), "
    "xgrammar or llguidance (pip install 'roofline[llguidance]')",
    "structured_outputs_config": "structured outputs as JSON, vLLM's name: '{\"backend\": "
    '"llguidance"}\' (overrides --structured-outputs-backend)',
    "gguf_keep_quantized": "GGUF on the CPU: multiply Q4_0/Q4_1/Q8_0 blocks as stored (fused "
    "integer kernels); --no-gguf-keep-quantized dequantizes them at load (the fp32 reference)",
}


def _sliding_window(model_config: ModelConfig) -> int | None:
    """The attention window of a checkpoint that uses one (Mistral v0.1), else None."""
    cfg = model_config.hf_config
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    page_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    policy: str = "fcfs"
    max_num_waiting: int | None = None
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    num_pages: int | None = None
    enforce_eager: bool = False
    cuda_graph_mode: str = "full"
    async_scheduling: bool | None = None
    speculative_config: dict | str | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    gguf_keep_quantized: bool = True
    cascade_attention: bool = True
    structured_outputs_backend: str = "auto"
    structured_outputs_config: dict | str | None = None

    def resolve_structured_outputs_backend(self) -> str:
        """The grammar library for structured outputs (checked before anything loads)."""
        from roofline.structured_output.backend import resolve_backend_name

        return resolve_backend_name(self.structured_outputs_backend, self.structured_outputs_config)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        return torch.device(self.device)

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            if device.type == "cpu":
                return torch.float32
            ckpt = model_config.torch_dtype
            return torch.float16 if ckpt in ("float16", "fp16") else torch.bfloat16
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(
                f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            ) from None

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            page_size=self.page_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            num_pages_override=self.num_pages,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def scheduler_config(self, model_config: ModelConfig, device: torch.device) -> SchedulerConfig:
        max_len = self.max_model_len
        window = _sliding_window(model_config)
        if max_len is None:
            max_len = model_config.max_position_embeddings
            if device.type == "cpu":
                max_len = min(max_len, 8192)
            if window is not None:
                max_len = min(max_len, window)
        elif max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's "
                f"max_position_embeddings={model_config.max_position_embeddings}"
            )
        elif window is not None and max_len > window:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's sliding window ({window}); "
                "sliding-window attention is not implemented, so contexts stay within it"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if device.type == "cuda" else 2048
            if not self.enable_chunked_prefill:
                budget = max(budget, max_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            policy=self.policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_waiting=self.max_num_waiting,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in fields(EngineArgs):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if str(f.type).startswith("bool") or isinstance(f.default, bool):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=f.default,
                    help=_HELP.get(f.name),
                )
                continue
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
            parser.add_argument(flag, type=kind, default=f.default, help=_HELP.get(f.name))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
