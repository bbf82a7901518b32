"""The quantization seam: a :class:`QuantizationConfig` hands every linear layer a
:class:`LinearMethod`, which owns that layer's weight tensors from creation to the matmul.

A layer (``layers.linear.MergedLinear``) knows its input size, its output shards (q/k/v, gate/up)
and its bias; everything about the weight goes through its method:

* ``create_weights(layer, in_features, output_sizes, params_dtype)`` registers the tensors the
  kernels read (``weight`` for 16-bit layers; ``qweight``/``scales``/``offsets`` and friends for
  quantized ones) on the layer, at their final size;
* ``load(layer, shard, name, tensor)`` takes one checkpoint tensor of output shard ``shard``
  under its checkpoint suffix (``weight``, ``bias``, ``qweight``, ``scales``, ``qzeros``,
  ``weight_scale``, ...), converting or quantizing it as it arrives, so loading never holds more
  than one 16-bit tensor beyond the final weights;
* ``process_weights_after_loading(layer)`` makes any kernel-specific copy (the MKL-packed fp32
  weight, a Triton repack) once every shard is in;
* ``apply(layer, x, bias)`` computes ``x @ W^T + bias``, choosing its kernel by the number of rows
  and the device.

``checkpoint_names`` tells the loader which suffixes every shard must provide, ``shard_slice``
tells tensor parallelism how to cut a named checkpoint tensor along the output or input
dimension, and ``fuses_silu_mul``/``apply_silu_mul`` let an MLP's down projection take the
SiLU-and-mul inside its GEMM where the method has such a kernel. Models never ask which scheme is
in use. :class:`UnquantizedLinearMethod` is the 16-bit (or fp32) path: the Triton skinny GEMM on
CUDA, MKL's packed single-row GEMM on the CPU, ``F.linear`` elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from roofline.quantization.moe import MoEMethod

ShardAxis = Literal["out", "in"]
"""Which dimension of the (unquantized) weight ``[out_features, in_features]`` a slice cuts."""


class LinearMethod(ABC):
    """How one linear layer stores, loads and multiplies its weight (see the module doc)."""

    quantized: bool = True
    """False only for the 16-bit path (dummy weights are then drawn straight into ``weight``)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's weight tensors (the bias is the layer's own)."""

    @abstractmethod
    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy (converting or quantizing) checkpoint tensor ``name`` of output shard ``shard``
        into the layer; raise ValueError on a shape or layout that does not fit."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every shard is loaded (and after dummy initialisation)."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [num_tokens, in_features] -> [num_tokens, out_features]`` in x's dtype."""

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        """Suffixes every output shard must be loaded under (besides ``bias``)."""
        return ("weight",)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        """Whether ``apply_silu_mul(layer, gate_up, bias)`` replaces
        ``apply(layer, silu_and_mul(gate_up), bias)`` for this input (shapes only, no sync)."""
        return False

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu(gate) * up`` fed into this layer's GEMM in one kernel (``gate_up [M, 2K]``)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused SiLU-and-mul GEMM")

    def fuses_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether ``apply_silu_mul_out(layer, x, bias)`` replaces
        ``silu_and_mul(apply(layer, x, bias))`` for this MLP's merged ``[gate; up]`` layer and
        input (the SiLU-and-mul in the GEMM's epilogue; shapes only, no sync)."""
        return False

    def apply_silu_mul_out(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu(x W_gate^T) * (x W_up^T)`` (``[num_tokens, out_features / 2]``) in one kernel."""
        raise NotImplementedError(f"{type(self).__name__} has no SiLU-epilogue GEMM")

    def shard_slice(
        self, name: str, tensor: torch.Tensor, axis: ShardAxis, start: int, size: int
    ) -> torch.Tensor:
        """The part of checkpoint tensor ``name`` that a tensor-parallel rank loads: elements
        ``[start, start + size)`` of the unquantized weight's ``axis`` (output rows or input
        columns). The default cuts a ``[out, in]`` weight (``[out]`` bias) where it stands;
        methods whose checkpoint tensors pack or group elements override it."""
        if axis == "out":
            return tensor.narrow(0, start, size)
        if name == "bias":
            return tensor
        return tensor.narrow(1, start, size)

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a forward pass reads for the weight (every registered tensor but the bias)."""
        return sum(
            t.numel() * t.element_size()
            for n, t in layer.named_parameters(recurse=False)
            if n != "bias"
        ) + sum(t.numel() * t.element_size() for _, t in layer.named_buffers(recurse=False))


class QuantizationConfig(ABC):
    """A quantization scheme for a whole model: which method each linear layer gets.

    ``prefix`` is the layer's HF-style module path (``model.layers.3.self_attn.qkv_proj``,
    ``model.layers.3.mlp.down_proj``, ``lm_head``); packed layers use their packed name."""

    name: str = "none"

    def planner_precision(self) -> tuple[str, str | None, int]:
        """(weight dtype, GEMM dtype or None, group size) for the planner's roofline
        (``planner.roofline.Precision``); 16-bit by default."""
        return "bf16", None, 128

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer at ``prefix``."""

    def quantizes_lm_head(self) -> bool:
        """Whether the LM head gets a quantized method (then a tied head gets its own copy)."""
        return False

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module | None:
        """A token embedding kept in the checkpoint's quantized form (its parameter ``weight``
        takes the checkpoint tensor as stored), or None for the float ``nn.Embedding``."""
        return None

    def get_moe_method(self, prefix: str) -> MoEMethod | None:
        """The method of the MoE experts at ``prefix`` (``model.layers.3.mlp.experts``); None
        when this scheme has no quantized expert kernels (a MoE model then refuses it)."""
        return None


def load_rows(
    target: torch.Tensor, offset: int, size: int, tensor: torch.Tensor, what: str
) -> None:
    """Copy ``tensor`` (first dim ``size``) into ``target[offset : offset + size]``."""
    if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
        want = (size, *target.shape[1:])
        raise ValueError(f"{what}: expected shape {want}, checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        target[offset : offset + size].copy_(tensor)


def shard_offset(layer: nn.Module, shard: int) -> tuple[int, int]:
    """(first output row, number of rows) of output shard ``shard`` of a merged layer."""
    sizes: list[int] = layer.output_sizes
    if not 0 <= shard < len(sizes):
        raise ValueError(f"shard {shard} out of range for a layer of {len(sizes)} shards")
    return sum(sizes[:shard]), sizes[shard]


def load_bias(layer: nn.Module, shard: int, tensor: torch.Tensor) -> None:
    """Load output shard ``shard`` of a checkpoint bias into ``layer.bias``."""
    if layer.bias is None:
        raise ValueError("checkpoint has a bias the layer was built without")
    offset, size = shard_offset(layer, shard)
    load_rows(layer.bias, offset, size, tensor, f"bias shard {shard}")


class UnquantizedLinearMethod(LinearMethod):
    """16-bit or fp32 weights ``[out_features, in_features]`` (the ``nn.Linear`` layout): the
    Triton skinny GEMM for a few rows of a tuned shape on CUDA (with the SiLU-and-mul fused into
    an MLP's down projection at one row), MKL's packed weight for single-row fp32 GEMMs on the
    CPU, ``F.linear`` otherwise. See ``layers.linear`` for when each applies."""

    quantized = False

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        total = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(total, in_features, dtype=params_dtype))
        layer._mkl_packed = None

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            load_bias(layer, shard, tensor)
            return
        if name != "weight":
            raise ValueError(
                f"an unquantized layer takes 'weight' and 'bias', not {name!r} (is the "
                "checkpoint quantized without a quantization_config?)"
            )
        offset, size = shard_offset(layer, shard)
        if tensor.shape[0] != size:
            raise ValueError(
                f"shard {shard}: expected {size} rows, checkpoint has {tensor.shape[0]}"
            )
        load_rows(layer.weight, offset, size, tensor, f"weight shard {shard}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from roofline.layers import linear as linear_mod

        layer._mkl_packed = linear_mod.mkl_prepack(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from roofline.layers import linear as linear_mod

        return linear_mod.linear(x, layer.weight, bias, layer._mkl_packed)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        """For at most SILU_MUL_MAX_ROWS rows, where ``apply`` on the activation's output would
        run the Triton skinny GEMM on a float weight of gate_up's dtype. The activation's output
        would be a fresh contiguous tensor of gate_up's rows, dtype and device, so the skinny
        GEMM's condition is tested on gate_up itself (against this weight's shape)."""
        from roofline.layers import linear as linear_mod

        weight = layer.weight
        return (
            gate_up.shape[0] <= linear_mod.SILU_MUL_MAX_ROWS
            and weight.dtype in linear_mod.FLOAT_DTYPES
            and weight.dtype == gate_up.dtype
            and linear_mod.skinny_gemm_applies(gate_up, weight)
        )

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        from roofline.kernels.gemv import skinny_gemm

        return skinny_gemm(gate_up, layer.weight, bias, silu_mul=True)
