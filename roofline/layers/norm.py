"""RMSNorm, optionally fused with the residual add that precedes it.

``forward(x, residual)`` computes ``x = x + residual`` first and returns ``(norm(x), x)``, so a
decoder layer carries the un-normed stream forward without a separate add. ``fp8=True`` (a
layer whose next GEMM runs fp8 W8A8) returns the normed rows quantized per token instead.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_MIN_ROWS = 16
"""``fp8=True`` quantizes the output only above this many rows: W8A8 layers run decode batches
up to ``quantization.common.DECODE_MAX_ROWS`` (16) on the weight-only kernels, which take 16-bit
rows."""


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden]
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        out = self.weight * (xf * torch.rsqrt(var + self.eps)).to(dtype)
        return out if residual is None else (out, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from roofline.kernels.rmsnorm import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            if fp8 and x.shape[0] > FP8_MIN_ROWS and x.dim() == 2:
                return self.forward_fp8(x, residual)
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The normed rows quantized per token to fp8 for a W8A8 GEMM (``quantization.fp8.
        Fp8Rows``; one launch with the residual add), the 16-bit rows never written."""
        from roofline.kernels.fp8_quant import rms_norm_quantize_fp8_per_token
        from roofline.quantization.fp8 import Fp8Rows

        q, scales, res_out = rms_norm_quantize_fp8_per_token(x, self.weight, self.eps, residual)
        rows = Fp8Rows(q, scales, x.dtype)
        return rows if residual is None else (rows, res_out)
