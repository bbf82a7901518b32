"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) along the
output dimension, so one GEMM serves them all.

``MergedLinear(in, [out_a, out_b, ...])`` loads shard ``i`` into rows
``sum(out[:i]) : sum(out[:i+1])`` through ``load_shard``; ``Linear`` is the one-shard case.
Quantization methods will plug in here as strategy objects on the layer.

On the CPU in fp32, ``prepack_for_cpu()`` keeps an MKL-packed copy of the weight: single-row
GEMMs (batch-1 decode) run on it 1.7x faster on AVX2 machines, since MKL then streams the weight
in its own blocked layout; other row counts take the plain path.

On CUDA, half-precision GEMMs of at most 8 rows (small-batch decode) whose weight shape has a
measured config in ``kernels.gemv.TUNED_CONFIGS`` run the Triton skinny GEMM: one launch where
cuBLAS adds a split-K reduction kernel, and faster on mid-size weights (Qwen3-0.6B o/down
1.5x, Llama-3.1-8B lm_head 1.1x on the H100). ``ROOFLINE_SKINNY_GEMM=0`` turns it off.
"""

from __future__ import annotations

import os

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
        self._mkl_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, sum(output_sizes)]
        return linear(x, self.weight, self.bias, self._mkl_packed)

    def prepack_for_cpu(self) -> None:
        self._mkl_packed = mkl_prepack(self.weight)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        target = self.bias if is_bias else self.weight
        assert target is not None, "checkpoint has a bias the layer was built without"
        if tensor.shape[0] != size:
            raise ValueError(
                f"shard {shard}: expected {size} rows, checkpoint has {tensor.shape[0]}"
            )
        with torch.no_grad():
            target[start : start + size].copy_(tensor)


class Linear(MergedLinear):
    """A plain linear layer (one shard), with the CPU packed path."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, [out_features], bias)


def mkl_prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL-packed copy of an fp32 CPU weight [out, in] for single-row GEMMs (None elsewhere)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch._C.has_mkl:
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mkl_packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``, through the packed MKL weight for a single row when there is one, or the
    Triton skinny GEMM for a few rows of a tuned shape on CUDA."""
    if mkl_packed is not None and x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkl._mkl_linear(x, mkl_packed, weight, bias, 1)
    if x.is_cuda and _SKINNY and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS:
        from roofline.kernels.gemv import TUNED_CONFIGS, m_bucket, skinny_gemm

        key = (weight.shape[0], weight.shape[1], m_bucket(x.shape[0]))
        if key in TUNED_CONFIGS and x.dtype in _HALF and x.is_contiguous():
            return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


SKINNY_MAX_ROWS = 8
_HALF = (torch.bfloat16, torch.float16)
_SKINNY = os.environ.get("ROOFLINE_SKINNY_GEMM", "1") != "0"
