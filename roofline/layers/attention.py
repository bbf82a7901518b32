"""The attention layer: hands q/k/v for one layer to the step's backend with that layer's cache.

Everything the step shares (metadata, the per-layer KV tensors, the backend) travels in a
:class:`ForwardContext` passed explicitly down the model; there is no global state. RoPE is
applied here too: by the rotary module, or, when the backend ``fuses_rope`` (the Triton one on
CUDA), by the backend inside its KV-cache store (one kernel instead of two per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from roofline.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: tuple | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rope = (positions, cos_sin_cache, qk_norm)`` asks the backend to rotate q and k
        first, after RMS-normalising each head when ``qk_norm = (q_w, k_w, eps)`` is not None
        (only passed to backends whose ``fuses_rope`` is True). ``kv_scales = (k_scale,
        v_scale)`` comes with a quantized cache (only to backends whose ``kv_cache_dtypes``
        name its dtype)."""
        ...


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, ...]]
    """Per layer (k_cache, v_cache), each [num_pages, page_size, num_kv_heads, head_dim]; a
    quantized cache adds (k_scale, v_scale) [num_pages, page_size, num_kv_heads] fp32
    (``quantization/kv_cache.py``), which the layer passes on as ``kv_scales``."""
    backend: AttentionBackend


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        positions: torch.Tensor | None = None,
        rotary: nn.Module | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        # positions: [num_tokens]; rotary: a RotaryEmbedding (None: q and k come rotated);
        # qk_norm: (q_norm weight, k_norm weight, eps), only with a backend that fuses RoPE
        k_cache, v_cache, *kv_scales = ctx.kv_caches[self.layer_idx]
        rope = None
        if rotary is not None:
            assert positions is not None
            if self.fuses_rope(q, ctx):
                rope = (positions, rotary.cos_sin_cache, qk_norm)
            else:
                assert qk_norm is None, "q/k norm is fused only with a backend that fuses RoPE"
                q, k = rotary(positions, q, k)
        extra: dict = {} if rope is None else {"rope": rope}
        if kv_scales:
            extra["kv_scales"] = tuple(kv_scales)
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, **extra)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    @staticmethod
    def fuses_rope(q: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether RoPE (and Qwen3's q/k norm) will run inside the backend's KV store."""
        return q.is_cuda and getattr(ctx.backend, "fuses_rope", False)
