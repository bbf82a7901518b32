"""fp8 (e4m3) weights: ``qweight`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[N]`` (one per
output channel; a per-tensor checkpoint scale is spread over its shard's rows), ``w = q * s``.

* weight-only (``fp8``): activations stay 16-bit; on CUDA ``common.quantized_linear`` picks
  the kernel by rows (``kernels.int4_gemv`` over the canonical e4m3 bytes up to
  ``GEMV_MAX_ROWS``, then ``kernels.mixed_gemm`` or dequantize + cuBLAS by its table).
* W8A8 (``fp8-w8a8``): above ``common.DECODE_MAX_ROWS`` rows on CUDA the activations are
  quantized per token (dynamic scales ``max|x_row| / 448``, one Triton launch:
  ``kernels.fp8_quant``; the RMSNorm before qkv and gate_up quantizes its own output:
  ``Fp8Rows``) and multiplied on fp8 tensor cores with the per-channel weight scales by the GEMM
  ``W8A8_GEMMS`` names for the shape and M (the descriptor GEMM ``kernels.fp8_gemm``, the
  Triton fp8 path of ``kernels.mixed_gemm``, or ``torch._scaled_mm``, by measurement; all of
  them accumulate as the fp8 tensor cores do, ``FAST_ACCUM``); an MLP's down projection gets
  ``silu(gate) * up`` quantized by the same launch (``fuses_silu_mul``), so the 16-bit
  activation is never written; decode-sized batches take the
  weight-only kernel (a weight read, where quantizing x buys nothing). On the CPU W8A8 computes
  what the tensor-core path does: x rounded to fp8 per token, both operands widened, an fp32
  matmul, both scales applied.

CUDA needs fp8 support (compute capability 8.9+: Ada, Hopper); ``check_fp8_device`` refuses
other GPUs before any weight loads. Checkpoints already in fp8 (``weight`` of dtype
float8_e4m3fn plus ``weight_scale`` per tensor or per channel) load as they are; their
``input_scale`` (static activation scales) is not used: scales are always dynamic.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn

from roofline.quantization import common, formats
from roofline.quantization.base import load_bias, shard_offset


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"fp8 quantization needs fp8 support (compute capability 8.9+: Ada, Hopper); {name} "
            "has none: use quantization='int8' instead"
        )


class Fp8Rows(NamedTuple):
    """Activations already quantized per token for W8A8 GEMMs (the RMSNorm before them did it:
    ``layers.norm.RMSNorm(..., fp8=True)``): what ``Fp8LinearMethod.apply`` takes instead of a
    16-bit x, so the normed 16-bit rows are never written and never re-read to quantize."""

    q: torch.Tensor  # fp8 [M, K]
    scales: torch.Tensor  # fp32 [M, 1]
    dtype: torch.dtype  # the activations' 16-bit dtype (the GEMM's output dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def takes_fp8_rows(linear: nn.Module | None) -> bool:
    """Whether ``linear`` (a ``MergedLinear`` whose forward is not overridden) runs W8A8, so its
    input norm may hand it ``Fp8Rows``."""
    from roofline.layers.linear import MergedLinear

    method = getattr(linear, "method", None)
    return (
        isinstance(linear, MergedLinear)
        and type(linear).forward is MergedLinear.forward
        and isinstance(method, Fp8LinearMethod)
        and method.w8a8
    )


def fp8_norms(layer: nn.Module) -> tuple[bool, bool]:
    """(input norm, post-attention norm) of a decoder layer that may quantize their output for
    the W8A8 GEMM they feed (``self_attn.qkv_proj``, ``mlp.gate_up_proj``; rows the fused
    kernel holds in registers)."""
    from roofline.kernels.fp8_quant import ONE_CHUNK_MAX

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norm = getattr(layer, "input_layernorm", None)
    if norm is None or norm.weight.numel() > ONE_CHUNK_MAX:
        return False, False
    return (
        takes_fp8_rows(getattr(attn, "qkv_proj", None)),
        takes_fp8_rows(getattr(mlp, "gate_up_proj", None)),
    )


class Fp8LinearMethod(common.CanonicalLinearMethod):
    kind = "fp8"

    def __init__(self, w8a8: bool = False, prequantized: bool = False) -> None:
        self.w8a8 = w8a8
        self.prequantized = prequantized

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        n = sum(output_sizes)
        common.add_param(layer, "qweight", (n, in_features), formats.FP8_DTYPE)
        common.add_param(layer, "scales", (n,), torch.float32)

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        return ("weight", "weight_scale") if self.prequantized else ("weight",)

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        offset, size = shard_offset(layer, shard)
        if name == "bias":
            load_bias(layer, shard, tensor)
        elif name == "weight" and tensor.dtype == formats.FP8_DTYPE:
            common.copy_shard_rows(layer, "qweight", shard, tensor)
        elif name == "weight":
            if self.prequantized:
                raise ValueError(f"fp8 checkpoint: weight shard {shard} is {tensor.dtype}, not fp8")
            common.check_weight_shard(layer, shard, tensor)
            q, scales = formats.quantize_fp8(tensor.to(layer.qweight.device))
            common.copy_shard_rows(layer, "qweight", shard, q)
            common.copy_shard_rows(layer, "scales", shard, scales)
        elif name == "weight_scale":
            scale = tensor.float().reshape(-1)
            if scale.numel() not in (1, size):
                raise ValueError(
                    f"weight_scale shard {shard}: {tuple(tensor.shape)} is neither per tensor "
                    f"nor per channel ({size} rows); block-wise fp8 is not supported"
                )
            common.copy_shard_rows(layer, "scales", shard, scale.expand(size))
        elif name == "input_scale":
            return  # static activation scales: unused (dynamic per-token scales instead)
        else:
            raise ValueError(f"an fp8 layer takes weight, weight_scale or bias, not {name!r}")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Rows):  # quantized by the norm before this layer (W8A8 only)
            if not x.q.is_cuda:
                return fp8_rows_ref(x, layer.qweight, layer.scales, bias)
            return fp8_gemm(x.q, x.scales, layer.qweight, layer.scales, bias, x.dtype)
        if not self.w8a8:
            return common.quantized_linear(self.kind, layer, x, bias)
        if x.is_cuda:
            if x.shape[0] <= common.DECODE_MAX_ROWS:
                return common.quantized_linear(self.kind, layer, x, bias)
            return w8a8_linear(x, layer.qweight, layer.scales, bias)
        return w8a8_ref(x, layer.qweight, layer.scales, bias)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        """W8A8 above DECODE_MAX_ROWS rows on CUDA: the activation is computed inside the
        per-token quantization launch; fewer rows: the weight-only decode kernels' rule."""
        if self.w8a8 and gate_up.is_cuda and gate_up.shape[0] > common.DECODE_MAX_ROWS:
            return gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.is_contiguous()
        return super().fuses_silu_mul(layer, gate_up)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.w8a8 and gate_up.is_cuda and gate_up.shape[0] > common.DECODE_MAX_ROWS:
            return w8a8_linear(gate_up, layer.qweight, layer.scales, bias, silu_mul=True)
        return super().apply_silu_mul(layer, gate_up, bias)

    def fuses_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Weight-only only (W8A8 quantizes the activation in its own launch)."""
        return not self.w8a8 and super().fuses_silu_mul_out(layer, x)

    def shard_slice(
        self, name: str, tensor: torch.Tensor, axis: str, start: int, size: int
    ) -> torch.Tensor:
        if name in ("weight_scale", "input_scale") and (axis == "in" or tensor.numel() == 1):
            return tensor
        return super().shard_slice(name, tensor, axis, start, size)


def w8a8_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # fp8 [N, K]
    scales: torch.Tensor,  # fp32 [N]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """W8A8 in plain torch: x quantized per token to fp8, fp32 matmul, both scales applied."""
    xq, x_scales = formats.quantize_fp8_per_token(x)  # [M, K] fp8, [M, 1]
    out = (xq.float() @ qweight.float().T) * x_scales * scales.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_rows_ref(
    rows: Fp8Rows,
    qweight: torch.Tensor,  # fp8 [N, K]
    scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N] in rows.dtype
    """``w8a8_ref`` for rows already quantized: fp32 matmul, both scales applied."""
    out = (rows.q.float() @ qweight.float().T) * rows.scales * scales.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(rows.dtype)


def w8a8_linear(
    x: torch.Tensor,  # [M, K] bf16/fp16 ([M, 2K] gate | up with silu_mul)
    qweight: torch.Tensor,  # fp8 [N, K]
    scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None,
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N]
    """W8A8 on CUDA for more than DECODE_MAX_ROWS rows: x quantized per token by one Triton
    launch (``kernels.fp8_quant``; with ``silu_mul`` the launch computes the MLP activation from
    gate/up first, so the 16-bit activation is never written), then the fp8 GEMM ``mixed_gemm``'s
    table measured faster for this shape and M: the Triton kernel (split-K where the tiles are
    few) or ``torch._scaled_mm``."""
    from roofline.kernels import fp8_quant

    x = x.contiguous()
    if silu_mul:
        xq, x_scales = fp8_quant.silu_mul_quantize_fp8_per_token(x)  # [M, K] fp8, [M, 1]
    else:
        xq, x_scales = fp8_quant.quantize_fp8_per_token(x)  # [M, K] fp8, [M, 1] fp32
    return fp8_gemm(xq, x_scales, qweight, scales, bias, x.dtype)


FAST_ACCUM = os.environ.get("ROOFLINE_W8A8_FAST_ACCUM", "1") != "0"
"""``torch._scaled_mm`` accumulates in the fp8 tensor cores' own precision, as ``tl.dot`` of the
Triton fp8 kernels does on Hopper, not promoted to fp32 every few K steps: H100, Llama-3.1-8B,
us at M = 251 / 8192: qkv 15.6 -> 14.6 / 311 -> 278, o 16.2 -> 13.6 / 209 -> 187, gate_up
64.3 -> 56.3 / 1550 -> 1281, down 38.0 -> 37.9 / 697 -> 646; max error relative to the largest
output 5e-3 .. 1.2e-2 (down, K = 14336) against 2e-3 .. 3e-3 promoted."""

W8A8_GEMMS: dict[tuple[int, int, int], tuple | str] = {
    # scripts/gpu_w8a8.py on an H100 80GB HBM3 (2026-11-24, check 2), Llama-3.1-8B, us; "lib":
    # _scaled_mm with fast accumulation; the offline run of that check used exactly this table.
    # M = 251: qkv lib 14.6 (descriptor GEMM 16.0, bf16 24.0), o mixed 13.4 (lib 13.7), gate_up
    # lib 56.0 (descriptor 61.8, mixed 63.9, bf16 101.2), down lib 37.5 (descriptor split-K 38.1)
    (6144, 4096, 256): "lib",
    (4096, 4096, 256): (64, 128, 128, 8, 1, 4, 4, 0),
    (28672, 4096, 256): "lib",
    (4096, 14336, 256): "lib",
    # M = 2048: qkv descriptor 73.4 (lib 74.8), o descriptor 49.8 (lib 50.7), gate_up lib 317.1
    # (descriptor 334.9), down descriptor 157.1 (lib 161.6)
    (6144, 4096, 2048): ("tma", 128, 256, 128, 8, 1, 8, 3, 1),
    (4096, 4096, 2048): ("tma", 128, 256, 128, 8, 1, 8, 3, 1),
    (28672, 4096, 2048): "lib",
    (4096, 14336, 2048): ("tma", 128, 256, 128, 8, 1, 8, 3, 1),
    # M = 8192: qkv lib 273.3 (descriptor 284.8, bf16 529.1), o lib 184.9 (189.9), gate_up lib
    # 1256.4 (1325.3), down descriptor 627.3 (lib 638.6)
    (6144, 4096, 8192): "lib",
    (4096, 4096, 8192): "lib",
    (28672, 4096, 8192): "lib",
    (4096, 14336, 8192): ("tma", 128, 256, 128, 8, 1, 8, 3, 1),
}
"""(N, K, M bucket of ``mixed_gemm_configs.m_bucket``) -> the W8A8 GEMM measured fastest there:
``("tma", *Fp8GemmConfig)`` (``kernels.fp8_gemm``, the descriptor GEMM), a ``MixedGemmConfig``
tuple (``kernels.mixed_gemm``'s fp8 path) or ``"lib"`` (``torch._scaled_mm``, ``FAST_ACCUM``).
Shapes and buckets it lacks take ``mixed_gemm``'s table (kind ``w8a8``), whose ``None`` (and
every bucket above 256 rows) means ``torch._scaled_mm`` too."""


def fp8_gemm(
    xq: torch.Tensor,  # fp8 [M, K]
    x_scales: torch.Tensor,  # fp32 [M, 1]
    qweight: torch.Tensor,  # fp8 [N, K]
    scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    from roofline.kernels import mixed_gemm

    n, k = qweight.shape
    m = xq.shape[0]
    pick = W8A8_GEMMS.get((n, k, mixed_gemm.m_bucket(m)))
    triton_ok = k % 64 == 0 and out_dtype in (torch.bfloat16, torch.float16)
    if isinstance(pick, tuple) and pick[0] == "tma":
        from roofline.kernels import fp8_gemm as tma

        if tma.applies(xq, qweight, out_dtype):
            cfg = tma.Fp8GemmConfig(*pick[1:])
            return tma.fp8_gemm(xq, x_scales, qweight, scales, bias, out_dtype, cfg)
    elif isinstance(pick, tuple) and triton_ok:
        cfg = mixed_gemm.MixedGemmConfig(*pick)
        return mixed_gemm.fp8_scaled_gemm(
            xq, x_scales, qweight, scales, bias, out_dtype, config=cfg
        )
    if pick is None and triton_ok:
        cfg = mixed_gemm.pick_config("w8a8", m, n, k, xq.device)
        if cfg is not None:
            return mixed_gemm.fp8_scaled_gemm(
                xq, x_scales, qweight, scales, bias, out_dtype, config=cfg
            )
    scale_b = scales.float().expand(n).contiguous()[None, :]  # [1, N] (per-tensor: repeated)
    out = torch._scaled_mm(
        xq, qweight.T, scale_a=x_scales, scale_b=scale_b, out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM,
    )  # fmt: skip
    return out if bias is None else out + bias


def _scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x quantized per token, then ``torch._scaled_mm`` (the library path, for benchmarks)."""
    from roofline.kernels.fp8_quant import quantize_fp8_per_token

    xq, x_scales = quantize_fp8_per_token(x.contiguous())  # [M, K] fp8, [M, 1] fp32 (one launch)
    scale_b = scales.float().expand(qweight.shape[0]).contiguous()[None, :]  # [1, N]
    out = torch._scaled_mm(xq, qweight.T, scale_a=x_scales, scale_b=scale_b, out_dtype=x.dtype)
    return out if bias is None else out + bias
