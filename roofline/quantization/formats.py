"""The canonical quantized weight layouts every kernel reads, in plain torch: packing, round-to-
nearest (RTN) quantization of a 16/32-bit weight, and dequantization (the reference the kernels
are tested against).

* int8: ``qweight`` int8 ``[N, K]``, ``scales`` ``[N, K // group]``; ``w = q * s``.
* int4: ``qweight`` uint8 ``[N, K // 2]`` (element ``k`` in byte ``k // 2``, low nibble for even
  ``k``), ``scales`` and ``offsets`` ``[N, K // group]``; ``w = q * s + offset``, ``q`` in 0..15.
* fp8: ``qweight`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[N]`` (or ``[1]``); ``w = q * s``.

Dequantization computes in fp32 (``q * s`` then ``+ offset``, each rounded once to fp32, the
order GGUF's reference dequantizer uses) and rounds once to the requested dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn


class Int4Weight(NamedTuple):
    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # [N, K // group]
    offsets: torch.Tensor  # [N, K // group]


class Int8Weight(NamedTuple):
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N, K // group]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` values 0..15 -> uint8 ``[N, K // 2]`` (even k low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> uint8 ``[N, K]`` values 0..15."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def check_group(in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise ValueError(
            f"group size {group_size} does not divide the layer's {in_features} input features"
        )


def quantize_int8(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> Int8Weight:
    """Symmetric RTN: ``s = max|w| / 127`` per group of ``group_size`` input elements."""
    n, k = weight.shape
    check_group(k, group_size)
    w = weight.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    scales = (w.abs().amax(dim=-1) / 127.0).to(scale_dtype)  # [N, G]
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = torch.round(w / s).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return Int8Weight(q, scales)


def quantize_int4(
    weight: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype
) -> Int4Weight:
    """RTN to 4 bits per group. Symmetric: ``s = max|w| / 7``, ``q = round(w / s) + 8`` in
    1..15 (offset ``-8 s``; nothing clipped). Asymmetric: the group's
    [min, max] mapped onto 0..15, ``s = (max - min) / 15``, zero point ``z = round(-min / s)``,
    offset ``-z s``."""
    n, k = weight.shape
    check_group(k, group_size)
    w = weight.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scales = (w.abs().amax(dim=-1) / 7.0).to(scale_dtype)  # [N, G]
        s = scales.float().clamp_min(tiny)
        q = torch.round(w / s[..., None]) + 8
        offsets = (-8.0 * scales.float()).to(scale_dtype)
    else:
        w_min = w.amin(dim=-1).clamp_max(0.0)
        w_max = w.amax(dim=-1).clamp_min(0.0)
        scales = ((w_max - w_min) / 15.0).to(scale_dtype)
        s = scales.float().clamp_min(tiny)
        zeros = torch.round(-w_min / s).clamp_(0, 15)
        q = torch.round(w / s[..., None]) + zeros[..., None]
        offsets = (-zeros * scales.float()).to(scale_dtype)
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Weight(pack_int4(q), scales, offsets)


def quantize_fp8(
    weight: torch.Tensor, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn ``[N, K]``, fp32 scales ``[N]`` or ``[1]``) with ``s = max|w| / 448``."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scales = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    s = scales[:, None] if per_channel else scales
    q = (w / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def _expand_groups(t: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] -> [N, K] fp32, each group value repeated over its K // G elements."""
    return t.float().repeat_interleave(k // t.shape[1], dim=1)


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    k = qweight.shape[1]
    return (qweight.float() * _expand_groups(scales, k)).to(dtype)  # [N, K]


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    q = unpack_int4(qweight)  # [N, K]
    k = q.shape[1]
    return (q.float() * _expand_groups(scales, k) + _expand_groups(offsets, k)).to(dtype)


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = scales.float()[:, None] if scales.numel() > 1 else scales.float()
    return (qweight.float() * s).to(dtype)  # [N, K]


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (fp8 ``[M, K]``, fp32 scales ``[M, 1]``)."""
    amax = x.float().abs().amax(dim=1, keepdim=True)  # [M, 1]
    scales = (amax / FP8_MAX).clamp_min(1e-12)
    q = (x.float() / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales
