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
``skinny_gemm_applies`` is that condition; where it holds for an MLP's down projection of one
row (batch-1 decode), ``forward_silu_mul`` runs the SiLU-and-mul inside the skinny GEMM (same
bits, one launch fewer).
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

    def fuses_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """Whether ``forward_silu_mul(gate_up)`` replaces ``self(silu_and_mul(gate_up))``: for at
        most SILU_MUL_MAX_ROWS rows, where the latter would run the Triton skinny GEMM on a plain
        (unquantized, forward not overridden) float weight of gate_up's dtype. The activation's
        output would be a fresh contiguous tensor of gate_up's rows, dtype and device, so the
        skinny GEMM's condition is tested on gate_up itself (against this weight's shape)."""
        return (
            gate_up.shape[0] <= SILU_MUL_MAX_ROWS
            and type(self).forward is MergedLinear.forward
            and self.weight.dtype in _FLOAT
            and self.weight.dtype == gate_up.dtype
            and skinny_gemm_applies(gate_up, self.weight)
        )

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * in_features] (gate | up) -> [num_tokens, sum(output_sizes)]
        from roofline.kernels.gemv import skinny_gemm

        return skinny_gemm(gate_up, self.weight, self.bias, silu_mul=True)

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
    if skinny_gemm_applies(x, weight):
        from roofline.kernels.gemv import skinny_gemm

        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs ``x @ weight.T`` on the Triton skinny GEMM: a contiguous 2-D
    half-precision CUDA x of at most SKINNY_MAX_ROWS rows, a measured config for (N, K) at x's
    row bucket, and ROOFLINE_SKINNY_GEMM not "0". Shapes only: no host sync, capturable."""
    if not (x.is_cuda and _SKINNY and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS):
        return False
    if x.dtype not in _HALF or not x.is_contiguous():
        return False
    from roofline.kernels.gemv import TUNED_CONFIGS, m_bucket

    return (weight.shape[0], weight.shape[1], m_bucket(x.shape[0])) in TUNED_CONFIGS


SKINNY_MAX_ROWS = 8
# Rows up to which an MLP's down projection takes the SiLU-and-mul in its skinny GEMM. Every
# program of the GEMM recomputes the SiLU of all M x K inputs, so it only pays at one row (H100,
# bf16, CUDA graphs, weights not in L2, us for silu_and_mul + skinny GEMM -> fused): Llama-3.1-8B
# down 43.7 -> 41.9 at M = 1, 44.7 -> 43.7 at 2, 45.8 -> 73.2 at 8; Qwen3-0.6B down 6.09 -> 5.35
# at 1, 8.41 -> 8.62 at 2, 8.24 -> 15.05 at 8.
SILU_MUL_MAX_ROWS = 1
_HALF = (torch.bfloat16, torch.float16)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_SKINNY = os.environ.get("ROOFLINE_SKINNY_GEMM", "1") != "0"
