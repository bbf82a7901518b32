"""SiLU-and-mul, the gated activation of Llama/Qwen MLPs: ``silu(x[:, :I]) * x[:, I:]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        if x.is_cuda:
            from roofline.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
