"""int8 weight-only quantization: ``qweight`` int8 ``[N, K]`` and ``scales`` ``[N, K // group]``
(group = K: one scale per output channel, the default), ``w = q * s``, activations stay 16-bit.

A 16-bit checkpoint is quantized as each tensor loads (symmetric round-to-nearest, on the
layer's device); tensors already in the layout (``qweight``, ``scales``: GGUF Q8_0, GPTQ 8-bit
after conversion) are copied as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.quantization import common, formats
from roofline.quantization.base import load_bias


class Int8LinearMethod(common.CanonicalLinearMethod):
    kind = "int8"

    def __init__(
        self,
        group_size: int | None = None,
        scale_dtype: torch.dtype | None = None,
        prequantized: bool = False,
    ) -> None:
        self.group_size = group_size  # None: per output channel
        self.scale_dtype = scale_dtype  # None: the model dtype
        self.prequantized = prequantized  # checkpoint gives qweight + scales

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        group = self.group_size or in_features
        formats.check_group(in_features, group)
        layer.group_size = group
        n = sum(output_sizes)
        common.add_param(layer, "qweight", (n, in_features), torch.int8)
        common.add_param(
            layer, "scales", (n, in_features // group), self.scale_dtype or params_dtype
        )

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        return ("qweight", "scales") if self.prequantized else ("weight",)

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            load_bias(layer, shard, tensor)
        elif name == "weight":
            common.check_weight_shard(layer, shard, tensor)
            w = tensor.to(layer.qweight.device)
            q = formats.quantize_int8(w, layer.group_size, layer.scales.dtype)
            common.copy_shard_rows(layer, "qweight", shard, q.qweight)
            common.copy_shard_rows(layer, "scales", shard, q.scales)
        elif name in ("qweight", "scales"):
            common.copy_shard_rows(layer, name, shard, tensor)
        else:
            raise ValueError(f"an int8 layer takes weight, qweight, scales or bias, not {name!r}")

    def shard_slice(
        self, name: str, tensor: torch.Tensor, axis: str, start: int, size: int
    ) -> torch.Tensor:
        if name == "scales" and axis == "in":
            return slice_groups(tensor, self.group_size, start, size)
        return super().shard_slice(name, tensor, axis, start, size)


def slice_groups(
    tensor: torch.Tensor, group_size: int | None, start: int, size: int
) -> torch.Tensor:
    """Columns of a ``[N, K // group]`` scale/offset tensor covering input elements
    ``[start, start + size)``; whole groups only (per-channel scales: the tensor as it is)."""
    if group_size is None:
        return tensor
    if start % group_size or size % group_size:
        raise ValueError(
            f"a tensor-parallel slice [{start}, {start + size}) of K cuts a group of {group_size}"
        )
    return tensor.narrow(1, start // group_size, size // group_size)
