"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) along the
output dimension, so one GEMM serves them all.

``MergedLinear(in, [out_a, out_b, ...])`` loads shard ``i`` into rows
``sum(out[:i]) : sum(out[:i+1])`` through ``load(shard, name, tensor)``; ``Linear`` is the
one-shard case. How the weight is stored, loaded and multiplied is the layer's ``method``
(``roofline.quantization``); the rest of this docstring is the 16-bit path,
``UnquantizedLinearMethod``, whose helpers live here.

On the CPU in fp32, ``process_weights_after_loading()`` keeps an MKL-packed copy of the weight:
single-row GEMMs (batch-1 decode) run on it 1.7x faster on AVX2 machines, since MKL then streams
the weight in its own blocked layout; other row counts take the plain path.

On CUDA, half-precision GEMMs of at most 8 rows (small-batch decode) whose weight shape has a
measured config in ``kernels.gemv.TUNED_CONFIGS`` run the Triton skinny GEMM: one launch where
cuBLAS adds a split-K reduction kernel, and faster on mid-size weights (Qwen3-0.6B o/down
1.5x, Llama-3.1-8B lm_head 1.1x on the H100). ``ROOFLINE_SKINNY_GEMM=0`` turns it off.
``skinny_gemm_applies`` is that condition; where it holds for an MLP's down projection of one
row (batch-1 decode), ``forward_silu_mul`` runs the SiLU-and-mul inside the skinny GEMM (same
bits, one launch fewer).

Other half-precision GEMMs on Hopper at row counts where cuBLAS's own choice is measured slow
take the row-count dispatch of ``layers.gemm_rows`` (cuBLAS on padded rows, or the descriptor
GEMM); the rest is ``F.linear``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from roofline.layers import gemm_rows

if TYPE_CHECKING:
    from roofline.quantization.base import LinearMethod


class MergedLinear(nn.Module):
    """``output_sizes`` shards packed along the output dimension, computed by one GEMM. The
    weight tensors belong to ``method`` (a ``quantization.base.LinearMethod``; the 16-bit
    ``UnquantizedLinearMethod`` when None); the bias, always in ``params_dtype``, to the layer.
    ``params_dtype`` defaults to torch's default dtype (the runner builds models under the
    model dtype)."""

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool = False,
        method: LinearMethod | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        from roofline.quantization.base import UnquantizedLinearMethod

        self.in_features = in_features
        self.output_sizes = list(out_features)
        self.method: LinearMethod = method if method is not None else UnquantizedLinearMethod()
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.method.create_weights(self, in_features, self.output_sizes, dtype)
        total = sum(out_features)
        self.bias = nn.Parameter(torch.zeros(total, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, sum(output_sizes)]
        return self.method.apply(self, x, self.bias)

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Load checkpoint tensor ``<module>.<name>`` of output shard ``shard`` (its method
        converts or quantizes it)."""
        self.method.load(self, shard, name, tensor)

    def load_shard(self, shard: int, tensor: torch.Tensor, is_bias: bool) -> None:
        self.load(shard, "bias" if is_bias else "weight", tensor)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def fuses_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """Whether ``forward_silu_mul(gate_up)`` replaces ``self(silu_and_mul(gate_up))`` (the
        method has a fused kernel for this input, and forward is not overridden)."""
        return type(self).forward is MergedLinear.forward and self.method.fuses_silu_mul(
            self, gate_up
        )

    def fuses_silu_mul_out(self, x: torch.Tensor) -> bool:
        """Whether ``forward_silu_mul_out(x)`` replaces ``silu_and_mul(self(x))`` (the
        SiLU-and-mul in the GEMM's epilogue) for an MLP's merged ``[gate; up]`` layer: 16-bit
        without bias, where the shape and row count have a band in ``gemm_rows.SILU_PLANS``;
        quantized, where its method says so (``LinearMethod.fuses_silu_mul_out``)."""
        weight = getattr(self, "weight", None)
        if isinstance(weight, torch.Tensor):  # 16-bit
            if self.bias is not None or gemm_rows.choose_silu(x, weight) is None:
                return False  # the common case: one dict lookup
            from roofline.quantization.base import UnquantizedLinearMethod

            if type(self.method) is not UnquantizedLinearMethod:
                return False
        elif not self.method.fuses_silu_mul_out(self, x):
            return False
        return (
            type(self).forward is MergedLinear.forward
            and len(self.output_sizes) == 2
            and self.output_sizes[0] == self.output_sizes[1]
        )

    def forward_silu_mul_out(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features / 2] (SiLU(gate) * up)
        weight = getattr(self, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return self.method.apply_silu_mul_out(self, x, self.bias)
        band = gemm_rows.choose_silu(x, weight)
        assert band is not None, "forward_silu_mul_out without fuses_silu_mul_out"
        return gemm_rows.run_silu(x, weight, band)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * in_features] (gate | up) -> [num_tokens, sum(output_sizes)]
        return self.method.apply_silu_mul(self, gate_up, self.bias)


class Linear(MergedLinear):
    """A plain linear layer (one shard)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, [out_features], bias, method, params_dtype)


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
    band = gemm_rows.choose(x, weight)
    if band is not None:
        return gemm_rows.run(x, weight, bias, band)
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
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SKINNY = os.environ.get("ROOFLINE_SKINNY_GEMM", "1") != "0"
