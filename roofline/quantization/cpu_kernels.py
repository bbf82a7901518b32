"""The compiled CPU kernels (``roofline.kernels.cpu``) behind ``common.register_cpu_kernel``:
int8 and int4 weights in the canonical layouts run ``kernels.cpu.ops.canonical_gemm`` (integer
dot products over the quantized rows, activations quantized per block of 32 to 16 bits by
default) instead of dequantizing the whole weight per call.

``install()`` registers them once, and only when the library loads (a C compiler is present and
``ROOFLINE_CPU_KERNELS`` is not ``0``); otherwise the CPU keeps the plain-torch path. Layers
whose groups are not a multiple of 32 (the kernel's block) take the plain-torch path per call,
as do fp8 weights (no CPU kernel). ``common.quantized_linear`` calls ``install()`` on the first
CPU GEMM of a quantized weight, so nothing is compiled for GPU-only runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from roofline.quantization import common, formats

BLOCK = 32  # the kernels' activation block: groups must be a multiple of it


def _gemm(
    bits: int,
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N] in x's dtype
    from roofline.kernels.cpu import ops

    k = qweight.shape[1] * (2 if bits == 4 else 1)
    num_groups = 1 if scales.dim() == 1 else scales.shape[1]
    if k % BLOCK or (k // num_groups) % BLOCK or not qweight.is_contiguous():
        weight = (
            formats.dequantize_int4(qweight, scales, offsets, x.dtype)
            if bits == 4
            else formats.dequantize_int8(qweight, scales, x.dtype)
        )
        return F.linear(x, weight, bias)
    scales2d = scales.reshape(qweight.shape[0], num_groups)
    lead = x.shape[:-1]
    y = ops.canonical_gemm(
        x.reshape(-1, x.shape[-1]),
        qweight,
        scales2d,
        offsets,
        bits,
        None if bias is None else bias.float().contiguous(),
    )  # [M, N] fp32
    return y.reshape(*lead, y.shape[-1]).to(x.dtype)


@functools.lru_cache(maxsize=1)
def install() -> bool:
    """Register the int8/int4 CPU kernels if the compiled library is available; True if so."""
    from roofline.kernels.cpu.build import load_library

    if load_library() is None:
        return False
    common.register_cpu_kernel("int8", functools.partial(_gemm, 8))
    common.register_cpu_kernel("int4", functools.partial(_gemm, 4))
    return True
