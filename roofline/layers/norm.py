"""RMSNorm, optionally fused with the residual add that precedes it.

``forward(x, residual)`` computes ``x = x + residual`` first and returns ``(norm(x), x)``, so a
decoder layer carries the un-normed stream forward without a separate add.
"""

from __future__ import annotations

import torch
from torch import nn


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
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)
