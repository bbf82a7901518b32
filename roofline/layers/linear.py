"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) along the
output dimension, so one GEMM serves them all.

``MergedLinear(in, [out_a, out_b, ...])`` loads shard ``i`` into rows
``sum(out[:i]) : sum(out[:i+1])`` through ``load_shard``. Quantization methods will plug in here
as strategy objects on the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(out_features)
        total = sum(out_features)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.zeros(total)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, sum(output_sizes)]
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        target = self.bias if is_bias else self.weight
        assert target is not None, "checkpoint has a bias the layer was built without"
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} rows, checkpoint has {tensor.shape[0]}")
        with torch.no_grad():
            target[start : start + size].copy_(tensor)
