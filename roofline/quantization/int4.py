"""int4 weight-only, group-wise quantization: ``qweight`` uint8 ``[N, K // 2]`` (two 4-bit values
per byte, even k in the low nibble), ``scales`` and ``offsets`` ``[N, K // group]``,
``w = q * s + offset``. Group 128 by default (32 and 64 allowed), symmetric (offset ``-8 s``) or
asymmetric (a zero point per group, offset ``-z s``).

A 16-bit checkpoint is quantized by round-to-nearest as each tensor loads; tensors already in the
layout (``qweight``, ``scales``, ``offsets``: GGUF Q4_0/Q4_1) are copied as they are. GPTQ and
AWQ checkpoints are converted into it by the methods in ``gptq.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.quantization import common, formats
from roofline.quantization.base import load_bias
from roofline.quantization.int8 import slice_groups

INT4_GROUP_SIZES = (32, 64, 128)


class Int4LinearMethod(common.CanonicalLinearMethod):
    kind = "int4"

    def __init__(
        self,
        group_size: int = 128,
        symmetric: bool = True,
        scale_dtype: torch.dtype | None = None,
        prequantized: bool = False,
    ) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.scale_dtype = scale_dtype  # None: the model dtype
        self.prequantized = prequantized  # checkpoint gives qweight + scales + offsets

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        formats.check_group(in_features, self.group_size)
        layer.group_size = self.group_size
        n, groups = sum(output_sizes), in_features // self.group_size
        dtype = self.scale_dtype or params_dtype
        common.add_param(layer, "qweight", (n, in_features // 2), torch.uint8)
        common.add_param(layer, "scales", (n, groups), dtype)
        common.add_param(layer, "offsets", (n, groups), dtype)

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        return ("qweight", "scales", "offsets") if self.prequantized else ("weight",)

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            load_bias(layer, shard, tensor)
        elif name == "weight":
            common.check_weight_shard(layer, shard, tensor)
            w = tensor.to(layer.qweight.device)
            q = formats.quantize_int4(w, self.group_size, self.symmetric, layer.scales.dtype)
            for part, value in zip(("qweight", "scales", "offsets"), q):
                common.copy_shard_rows(layer, part, shard, value)
        elif name in ("qweight", "scales", "offsets"):
            common.copy_shard_rows(layer, name, shard, tensor)
        else:
            raise ValueError(
                f"an int4 layer takes weight, qweight, scales, offsets or bias, not {name!r}"
            )

    def shard_slice(
        self, name: str, tensor: torch.Tensor, axis: str, start: int, size: int
    ) -> torch.Tensor:
        if axis == "in" and name in ("scales", "offsets"):
            return slice_groups(tensor, self.group_size, start, size)
        if axis == "in" and name == "qweight":
            return tensor.narrow(1, start // 2, size // 2)
        return super().shard_slice(name, tensor, axis, start, size)
