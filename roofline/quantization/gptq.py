"""Pre-quantized HF checkpoints loaded as they are (``config.json``'s ``quantization_config``):
GPTQ (4 or 8 bits, ``desc_act`` false), AWQ (GEMM layout) and FP8 (per-tensor or per-channel
``weight_scale``), each converted tensor by tensor into the canonical layouts of ``formats``.

* GPTQ: ``qweight`` int32 ``[K * bits / 32, N]`` (element ``k`` of column ``n`` at bits
  ``(k % (32 / bits)) * bits`` of row ``k * bits // 32``), ``qzeros`` int32
  ``[K / g, N * bits / 32]`` packed the same way along N and stored minus one
  (``checkpoint_format`` ``gptq``; ``gptq_v2`` stores them as they are), ``scales`` fp16
  ``[K / g, N]``, ``g_idx`` ``[K]``;
  ``w = (q - z) * s``. 4 bits -> int4 (offset ``-z s``); 8 bits -> int8 with ``q - 128``
  (symmetric checkpoints only: an asymmetric 8-bit zero point does not fit the int8 layout).
* AWQ (GEMM): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` ``[K / g, N / 8]``, eight columns
  per int32 in the order ``AWQ_ORDER`` (nibble ``i`` holds column ``AWQ_ORDER[i]``), zero points
  as they are; ``scales`` fp16 ``[K / g, N]``.

Zero points and scales arrive as separate tensors; the offsets are made once both are in
(``process_weights_after_loading``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from roofline.config import ModelConfig
from roofline.quantization import common, formats
from roofline.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    load_bias,
    shard_offset,
)
from roofline.quantization.fp8 import Fp8LinearMethod, check_fp8_device
from roofline.quantization.int4 import Int4LinearMethod
from roofline.quantization.int8 import Int8LinearMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_HF_NAMES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` -> ``[R, C * 32 / bits]``: value ``j`` of an int32 at bit ``j * bits``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per]
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    return values.reshape(packed.shape[0], packed.shape[1] * per)


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ ``[K * bits / 32, N]`` -> uint8 ``[N, K]`` (packed along K)."""
    return unpack_cols(qweight.T.contiguous(), bits).to(torch.uint8)  # [N, K]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ ``[R, N / 8]`` -> uint8 ``[R, N]`` in column order."""
    nibbles = unpack_cols(packed, 4).reshape(packed.shape[0], -1, 8)  # [R, N / 8, 8]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1).to(torch.uint8)


class PackedIntLinearMethod(LinearMethod):
    """GPTQ or AWQ tensors into the int4 (or, for GPTQ 8-bit, int8) layout."""

    def __init__(self, fmt: str, bits: int, group_size: int | None, zero_offset: int) -> None:
        self.fmt, self.bits, self.group_size = fmt, bits, group_size
        self.zero_offset = zero_offset  # GPTQ v1 stores z - 1
        self.inner: LinearMethod
        self.inner = (
            Int4LinearMethod(0, scale_dtype=torch.float16)
            if bits == 4
            else (Int8LinearMethod(0, scale_dtype=torch.float16))
        )
        self.kind = "int4" if bits == 4 else "int8"

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        group = self.group_size or in_features
        self.inner.group_size = group
        self.inner.create_weights(layer, in_features, output_sizes, params_dtype)
        n = sum(output_sizes)
        layer.register_buffer("zeros", torch.zeros(n, in_features // group, dtype=torch.uint8))

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        _, size = shard_offset(layer, shard)
        k, groups = layer.in_features, layer.scales.shape[1]
        if name == "bias":
            load_bias(layer, shard, tensor)
        elif name == "g_idx":
            trivial = torch.arange(k, device=tensor.device) // (k // groups)
            if tensor.shape != (k,) or not torch.equal(tensor.long(), trivial):
                raise ValueError(
                    "GPTQ act-order (a g_idx that is not k // group_size) is not supported"
                )
        elif name == "scales":
            self._expect(name, tensor, (groups, size))
            common.copy_shard_rows(layer, "scales", shard, tensor.T.to(torch.float16))
        elif name == "qweight":
            if self.fmt == "awq":
                self._expect(name, tensor, (k, size // 8))
                q = unpack_awq(tensor).T  # [N, K]
            else:
                self._expect(name, tensor, (k * self.bits // 32, size))
                q = unpack_gptq_qweight(tensor, self.bits)  # [N, K]
            if self.bits == 4:
                common.copy_shard_rows(layer, "qweight", shard, formats.pack_int4(q))
            else:
                common.copy_shard_rows(layer, "qweight", shard, (q.short() - 128).to(torch.int8))
        elif name == "qzeros":
            self._expect(name, tensor, (groups, size * self.bits // 32))
            z = unpack_awq(tensor) if self.fmt == "awq" else unpack_cols(tensor, self.bits)
            z = (z + self.zero_offset).T  # [N, G]
            if self.bits == 8 and not bool((z == 128).all()):
                raise ValueError("asymmetric 8-bit GPTQ zero points are not supported")
            common.copy_shard_rows(layer, "zeros", shard, z.to(torch.uint8))
        else:
            raise ValueError(
                f"a {self.fmt} layer takes qweight, qzeros, scales, g_idx, bias; not {name!r}"
            )

    def _expect(self, name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.fmt} {self.bits}-bit {name}: expected {shape}, checkpoint has "
                f"{tuple(tensor.shape)} (packing or group size does not match the config)"
            )

    def shard_slice(
        self, name: str, tensor: torch.Tensor, axis: str, start: int, size: int
    ) -> torch.Tensor:
        """Slices in the checkpoint's own orientation ([K-ish, N-ish]); packed dims move in
        whole int32 words, grouped dims in whole groups (``g_idx`` re-based to the slice)."""
        if name == "bias":
            return tensor.narrow(0, start, size) if axis == "out" else tensor
        per = 32 // self.bits
        group = self.group_size
        if axis == "out":
            packed_n = name == "qzeros" or (self.fmt == "awq" and name == "qweight")
            if name == "g_idx":
                return tensor
            if packed_n and (start % per or size % per):
                raise ValueError(f"a slice of {size} outputs at {start} splits packed {name}")
            return (
                tensor.narrow(1, start // per, size // per)
                if packed_n
                else (tensor.narrow(1, start, size))
            )
        if group is None:
            raise ValueError("per-channel GPTQ layers cannot be sliced along their input")
        if start % group or size % group:
            raise ValueError(f"a slice [{start}, {start + size}) of K cuts a group of {group}")
        if name in ("scales", "qzeros"):
            return tensor.narrow(0, start // group, size // group)
        if name == "g_idx":
            return tensor.narrow(0, start, size) - start // group
        if self.fmt == "gptq":
            return tensor.narrow(0, start // per, size // per)
        return tensor.narrow(0, start, size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.bits == 4:
            with torch.no_grad():
                layer.offsets.copy_((-layer.zeros.float() * layer.scales.float()).to(torch.float16))
        del layer.zeros
        common.prepare_kernel_layout(self.kind, layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        return self.inner.fuses_silu_mul(layer, gate_up)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return self.inner.apply_silu_mul(layer, gate_up, bias)

    def fuses_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return self.inner.fuses_silu_mul_out(layer, x)

    def apply_silu_mul_out(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return self.inner.apply_silu_mul_out(layer, x, bias)


class CheckpointConfig(QuantizationConfig):
    """One method factory for the quantized layers, 16-bit for the ones the checkpoint left."""

    def __init__(
        self,
        name: str,
        make,
        skipped: list[str],
        lm_head: bool,
        precision: tuple[str, str | None, int],
    ) -> None:
        self.name, self.make, self.skipped, self.lm_head = name, make, skipped, lm_head
        self.precision = precision

    def planner_precision(self) -> tuple[str, str | None, int]:
        return self.precision

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if prefix == "lm_head":
            return self.make() if self.lm_head else UnquantizedLinearMethod()
        module = prefix.rsplit(".", 1)[-1]
        names = [prefix.rsplit(".", 1)[0] + "." + n for n in _HF_NAMES.get(module, (module,))]
        skipped = [any(n.endswith(s) or s in n.split(".") for s in self.skipped) for n in names]
        if all(skipped) and self.skipped:
            return UnquantizedLinearMethod()
        if any(skipped):
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of {names}")
        return self.make()


def checkpoint_config(
    qc: dict[str, Any], cfg: ModelConfig, device: torch.device
) -> QuantizationConfig:
    method = str(qc.get("quant_method", "")).lower()
    skipped = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        if qc.get("desc_act"):
            raise ValueError("GPTQ act-order checkpoints (desc_act: true) are not supported")
        if bits == 8 and not qc.get("sym", True):
            raise ValueError("asymmetric 8-bit GPTQ checkpoints are not supported")
        group = int(qc.get("group_size", 128))
        group = None if group == -1 else group
        zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
        _check_group(cfg, group, "gptq")
        make = functools.partial(PackedIntLinearMethod, "gptq", bits, group, zero_offset)
        precision = ("int4" if bits == 4 else "int8", "bf16", group or cfg.hidden_size)
        return CheckpointConfig("gptq", make, skipped, bool(qc.get("lm_head", False)), precision)
    if method == "awq":
        if int(qc.get("bits", qc.get("w_bit", 4))) != 4:
            raise ValueError("AWQ checkpoints must be 4-bit")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        _check_group(cfg, group, "awq")
        make = functools.partial(PackedIntLinearMethod, "awq", 4, group, 0)
        return CheckpointConfig("awq", make, skipped, False, ("int4", "bf16", group))
    if method == "fp8":
        if qc.get("weight_block_size") is not None:
            raise ValueError("block-wise fp8 checkpoints (weight_block_size) are not supported")
        check_fp8_device(device)
        make = functools.partial(Fp8LinearMethod, w8a8=True, prequantized=True)
        return CheckpointConfig("fp8", make, skipped, False, ("fp8", None, 128))
    raise ValueError(
        f"checkpoint quant_method {method!r} is not supported (supported: gptq, awq, fp8)"
    )


def _check_group(cfg: ModelConfig, group: int | None, what: str) -> None:
    if group is None:
        return
    from roofline.quantization.registry import layer_in_features

    for layer, k in layer_in_features(cfg).items():
        if k % group:
            raise ValueError(f"{what}: group size {group} does not divide {layer}'s {k} inputs")
