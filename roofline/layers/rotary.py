"""Rotary position embedding (rotate-half layout, as HF Llama/Qwen) and its scaling variants.

The cos/sin table is built once: ``cos_sin_cache[pos] = [cos(pos * inv_freq), sin(pos * inv_freq)]``
with shape ``[max_positions, head_dim]`` (cos in the first half, sin in the second), in fp32.
``llama3`` and ``linear`` scaling only change ``inv_freq``.

Every value matches HF's ``LlamaRotaryEmbedding`` bit for bit: ``inv_freq`` is computed on the CPU
in fp32 by the same expressions as HF's rope init functions, and the fp32 products and cos/sin are
taken on the model's device, where HF takes them (CUDA's and the CPU's cos/sin can differ by an
ulp). Both rotation paths then round cos/sin to q's dtype and every product and sum after it, as
HF's ``apply_rotary_pos_emb`` does in half precision (``roofline/kernels/rotary.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with the checkpoint's scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]`` table on ``inv_freq``'s device."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_positions, head_dim), persistent=False
        )
        if not self.cos_sin_cache.is_meta:
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the table on the module's device (after ``to_empty``)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)  # fp32, on the CPU
        device = self.cos_sin_cache.device
        self.cos_sin_cache = build_cos_sin_cache(inv_freq.to(device), self.max_positions)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim];
        # k: [num_tokens, num_kv_heads, head_dim]
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [num_tokens, head_dim]
        half = self.head_dim // 2
        cos = cos_sin[:, None, :half].to(q.dtype)  # [num_tokens, 1, half], as HF casts cos/sin
        sin = cos_sin[:, None, half:].to(q.dtype)
        return _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)

    def forward_cuda(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from roofline.kernels.rotary import apply_rotary

        return apply_rotary(q, k, positions, self.cos_sin_cache)  # in place, strided views ok

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:
            return self.forward_cuda(positions, q, k)
        return self.forward_native(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin, with the same eager ops (and roundings) in x's dtype.
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
