"""What every quantized linear method shares: registering its tensors, copying canonical
tensors into output-shard rows, and ``quantized_linear``, which picks the kernel for a weight in
one of the canonical layouts (``formats``) by device and number of rows:

* CUDA, at most ``GEMV_MAX_ROWS`` rows (16; ``ROOFLINE_QUANT_GEMV_MAX_ROWS``): int4, int8
  and fp8 layers ``kernels.int4_gemv`` (tensor cores over the ``gemv_words``
  ``prepare_kernel_layout`` set after loading: a repacked copy, or the canonical bytes
  themselves) where it takes the weight, else ``kernels.quant_gemv`` (magic-number
  unpacking, tuned per shape);
* CUDA (Hopper), more than ``DECODE_MAX_ROWS`` rows, int8 and fp8 per channel and int4 at the
  shapes and M buckets of ``kernels.wo_gemm_configs.WO_CONFIGS``: ``kernels.wo_gemm``
  (``ROOFLINE_WO_GEMM=0``: off); an MLP's gate_up layer there may run with the SiLU-and-mul in
  the warp-specialized kernel's epilogue (``silu_out_choice``, ``ROOFLINE_WO_SILU=0``: off);
* CUDA, more than ``DECODE_MAX_ROWS`` rows: ``kernels.mixed_gemm`` (weights read packed and
  widened in registers into 16-bit tensor-core MMAs; configs tuned per shape and M bucket),
  or dequantize + cuBLAS where its table measured that faster (``ROOFLINE_QUANT_MIXED_GEMM=0``:
  the two older paths below instead);
* CUDA, at most ``fused_max_rows`` rows (64, 128 for large weights; measured): the fused
  dequant GEMM
  (``kernels.dequant_gemm.dequant_gemm``: the weight read once per 16 rows up to 16, once per 64
  rows beyond);
* CUDA, more rows (prefill): the weight dequantized by one Triton launch into a 16-bit buffer,
  then cuBLAS. ``ROOFLINE_QUANT_FUSED_MAX_ROWS`` fixes the switch (0: always dequantize +
  cuBLAS); ``scripts/gpu_quant.py`` times both at each M to set it;
* CPU: ``CPU_KERNELS[kind]`` if one is registered (``register_cpu_kernel``; ``cpu_kernels``
  registers the compiled int8/int4 kernels on the first CPU call), else dequantize per call
  (``formats``) and ``F.linear``: correct, not fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from roofline.quantization import formats
from roofline.quantization.base import LinearMethod, load_rows, shard_offset

DECODE_MAX_ROWS = 16
# Rows up to which the generic fused GEMM beats dequantize + cuBLAS (H100, 8B shapes,
# scripts/gpu_quant.py): at 128 rows dequantize + cuBLAS wins on o_proj (16.8M weights: 27-30 vs
# 33-37 us) and the fused GEMM on gate_up (117M: 129-143 vs 214-224 us, the dequantized copy
# costs more than the second weight read). ROOFLINE_QUANT_FUSED_MAX_ROWS fixes one switch.
_FUSED_MAX_ROWS_ENV = os.environ.get("ROOFLINE_QUANT_FUSED_MAX_ROWS")
FUSED_LARGE_WEIGHT = 32 << 20  # weights of at least this many elements keep the fused GEMM longer


def fused_max_rows(num_weights: int) -> int:
    """The largest M that takes the fused dequant GEMM for a weight of ``num_weights``."""
    if _FUSED_MAX_ROWS_ENV is not None:
        return int(_FUSED_MAX_ROWS_ENV)
    return 128 if num_weights >= FUSED_LARGE_WEIGHT else 64


# Decode batches (<= DECODE_MAX_ROWS rows) take kernels.quant_gemv where it supports the weight;
# ROOFLINE_QUANT_GEMV=0 keeps them on the generic fused dequant GEMM (A/B runs).
USE_QUANT_GEMV = os.environ.get("ROOFLINE_QUANT_GEMV", "1") != "0"
GEMV_MAX_ROWS = int(os.environ.get("ROOFLINE_QUANT_GEMV_MAX_ROWS", str(DECODE_MAX_ROWS)))

# More than DECODE_MAX_ROWS rows take kernels.mixed_gemm (tensor cores, the weight read packed)
# or, where its tuned table says so, dequantize + cuBLAS; ROOFLINE_QUANT_MIXED_GEMM=0 keeps the
# older choice below (the generic fused GEMM up to fused_max_rows, then dequantize + cuBLAS).
USE_MIXED_GEMM = os.environ.get("ROOFLINE_QUANT_MIXED_GEMM", "1") != "0"
# Before it, int8 / fp8 (per channel) and int4 layers take kernels.wo_gemm (Hopper: TMA, register-A
# wgmma overlapping the next tile's widening) at the shapes and M buckets of its measured table;
# ROOFLINE_WO_GEMM=0 keeps them on kernels.mixed_gemm.
USE_WO_GEMM = os.environ.get("ROOFLINE_WO_GEMM", "1") != "0"
# An MLP's gate_up layer whose wo_gemm config is the warp-specialized form runs with the
# SiLU-and-mul in that kernel's epilogue (the [M, 2I] product never written nor read back, no
# silu_and_mul launch); ROOFLINE_WO_SILU=0 keeps the GEMM and the activation apart (A/B runs).
USE_WO_SILU = os.environ.get("ROOFLINE_WO_SILU", "1") != "0"

# int4 decode batches take kernels.int4_gemv (tensor cores, a repacked copy of the weight made by
# prepare_kernel_layout); ROOFLINE_INT4_GEMV=0 keeps them on kernels.quant_gemv (A/B runs).
# int8 takes it too, as two nibble planes (H100, 8B shapes: 1.0-1.06x quant_gemv at one row,
# 1.4-3x at 4-16 rows); ROOFLINE_INT8_GEMV=0 keeps int8 on quant_gemv.
USE_INT4_GEMV = os.environ.get("ROOFLINE_INT4_GEMV", "1") != "0"
USE_INT8_GEMV = os.environ.get("ROOFLINE_INT8_GEMV", "1") != "0"
# fp8 weight-only decode batches take it over the canonical e4m3 weight itself (no copy);
# ROOFLINE_FP8_GEMV=0 keeps them on kernels.quant_gemv.
USE_FP8_GEMV = os.environ.get("ROOFLINE_FP8_GEMV", "1") != "0"
# Per-channel int8 layers give kernels.int4_gemv their canonical qweight and [N] scales as they
# are (one copy of the weight; each byte widened to a 16-bit operand as fp8's e4m3 bytes are, the
# row's scale applied once at the end); ROOFLINE_INT8_GEMV_PLANES=1 keeps the repacked nibble
# planes instead (a second copy; A/B runs). H100, 8B batch 1 (scripts/gpu_gemv8.py --quick):
# 303.2 tok/s, 8.46 GiB resident (planes 282.0, 14.97 GiB); batch 8 4.61 ms a step (planes 5.33).
INT8_GEMV_PLANES = os.environ.get("ROOFLINE_INT8_GEMV_PLANES", "0") == "1"
# int4 layers whose groups hold whole 128-element tiles give kernels.int4_gemv their canonical
# qweight as it is (one copy of the weight): the words widened as repacked ones are, x permuted
# per tile to their K order (int4_gemv.CANON4_XPERM). H100, 8B (scripts/gpu_gemv8.py --quick,
# one run): batch 1 408.2 tok/s, 5.41 GiB resident (repacked 401.5, 8.66 GiB); batch 8 3.74 vs
# 3.60 ms a step (o and down at 4-8 rows: the x permute costs there), batch 32 5.45 both.
# ROOFLINE_INT4_GEMV_CANONICAL=0 repacks (a second copy; A/B runs). The halves of the words
# interleaved into natural order instead had measured 266 vs 401 tok/s.
INT4_GEMV_CANONICAL = os.environ.get("ROOFLINE_INT4_GEMV_CANONICAL", "1") == "1"
# ROOFLINE_GEMV_CANONICAL=1: int4 and group-wise int8 layers (groups of 128k) read canonically.
# Symmetric int4 layers hand int4_gemv their scales alone (the offset is -8 s; 8B batch 1 401.5
# vs 400.0 tok/s with pairs, 0.2 GiB less); 1: (scale, offset) pairs, a copy, as asymmetric
# layers (A/B runs).
INT4_GEMV_PAIRS = os.environ.get("ROOFLINE_INT4_GEMV_PAIRS", "0") == "1"
CANONICAL_GEMV = os.environ.get("ROOFLINE_GEMV_CANONICAL", "0") == "1"
# The down projection's SiLU-and-mul inside int4_gemv, by bits ("fp8": e4m3), else a
# silu_and_mul launch first (H100, 8B down at one row, scripts/gpu_gemv8.py: int4 fused 24.0 us
# vs 18.9 apart; int8 29.0 vs 28.6; fp8 25.9 vs 28.9). The fused decode layer's MLP takes neither
# where the gate | up GEMV computes the SiLU itself (layers.fused_decode.SILU_EPILOGUE).
# Per-channel int8 read as it is ("i8"): fused 25.3 vs apart 27.7 us (scripts/gpu_gemv8.py).
GEMV_FUSE_SILU: dict[int | str, bool] = {4: False, 8: False, "fp8": True, "i8": True}


def gemv_fuses_silu(layer: nn.Module) -> bool:
    """Whether ``int4_gemv`` takes this repacked layer's SiLU-and-mul as its prologue."""
    from roofline.kernels.int4_gemv import table_format

    fmt = table_format(layer.gemv_words, layer.gemv_bits, layer.gemv_group)
    return GEMV_FUSE_SILU[fmt if fmt in ("fp8", "i8") else layer.gemv_bits]


CpuKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    torch.Tensor,
]
"""``fn(x, qweight, scales, offsets, bias) -> x @ W^T + bias`` for one canonical layout."""
CPU_KERNELS: dict[str, CpuKernel] = {}
# False: CPU GEMMs take the plain-torch dequantize path even where a kernel is registered
# (the reference the CPU kernels are tested against).
USE_CPU_KERNELS = os.environ.get("ROOFLINE_QUANT_CPU_KERNELS", "1") != "0"


def register_cpu_kernel(kind: str, fn: CpuKernel) -> None:
    """Route CPU GEMMs of weights of ``kind`` (``int8``, ``int4``, ``fp8``) through ``fn``."""
    if kind not in ("int8", "int4", "fp8"):
        raise ValueError(f"unknown quantized layout {kind!r}")
    CPU_KERNELS[kind] = fn


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Register a frozen parameter (quantized tensors cannot require grad)."""
    tensor = (
        torch.zeros(shape, dtype=dtype)
        if dtype.is_floating_point
        else torch.empty(shape, dtype=dtype)
    )
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def check_weight_shard(layer: nn.Module, shard: int, tensor: torch.Tensor) -> None:
    """A 16-bit ``weight`` shard about to be quantized must be ``[shard rows, in_features]``."""
    _, size = shard_offset(layer, shard)
    if tuple(tensor.shape) != (size, layer.in_features):
        raise ValueError(
            f"weight shard {shard}: expected {(size, layer.in_features)}, "
            f"checkpoint has {tuple(tensor.shape)}"
        )


def copy_shard_rows(layer: nn.Module, name: str, shard: int, tensor: torch.Tensor) -> None:
    """Copy a canonical tensor of output shard ``shard`` into the rows of ``layer.<name>``."""
    offset, size = shard_offset(layer, shard)
    target: torch.Tensor = getattr(layer, name)
    load_rows(target, offset, size, tensor.to(target.device), f"{name} shard {shard}")


def dequantize(kind: str, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's whole weight ``[N, K]`` in ``dtype``, in plain torch."""
    offsets = getattr(layer, "offsets", None)
    if kind == "int8":
        return formats.dequantize_int8(layer.qweight, layer.scales, dtype)
    if kind == "int4":
        return formats.dequantize_int4(layer.qweight, layer.scales, offsets, dtype)
    return formats.dequantize_fp8(layer.qweight, layer.scales, dtype)


def quantized_linear(
    kind: str, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T + bias`` for a weight in canonical layout ``kind`` (see the module doc)."""
    offsets = getattr(layer, "offsets", None)
    if not x.is_cuda:
        cpu = None
        if USE_CPU_KERNELS:
            from roofline.quantization import cpu_kernels

            cpu_kernels.install()  # once: registers the compiled kernels if they load
            cpu = CPU_KERNELS.get(kind)
        if cpu is not None:
            return cpu(x, layer.qweight, layer.scales, offsets, bias)
        return F.linear(x, dequantize(kind, layer, x.dtype), bias)
    from roofline.kernels import dequant_gemm as kernels

    words = getattr(layer, "gemv_words", None)
    if words is not None and x.shape[0] <= GEMV_MAX_ROWS:
        from roofline.kernels import int4_gemv

        x = x.contiguous()
        bits = layer.gemv_bits
        if int4_gemv.supports(x, words, layer.gemv_group, bits=bits):
            return int4_gemv.int4_gemv(x, words, layer.gemv_pairs, bias, bits=bits)
    if x.shape[0] <= GEMV_MAX_ROWS and USE_QUANT_GEMV:
        from roofline.kernels import quant_gemv

        x = x.contiguous()
        if quant_gemv.supports(kind, x, layer.qweight, layer.scales):
            return quant_gemv.quant_gemv(kind, x, layer.qweight, layer.scales, offsets, bias)
    n, k = layer.qweight.shape[0], x.shape[-1]
    if USE_WO_GEMM and x.shape[0] > DECODE_MAX_ROWS and kind in ("int8", "int4", "fp8"):
        from roofline.kernels import wo_gemm

        for name, offs in wo_candidates(kind, layer, x.dtype):
            cfg = wo_gemm.pick(name, x.shape[0], n, k)
            if cfg is not None and wo_gemm.supports(kind, x, layer.qweight, layer.scales, cfg):
                return wo_gemm.wo_gemm(kind, x, layer.qweight, layer.scales, offs, bias, cfg)
    if USE_MIXED_GEMM and x.shape[0] > DECODE_MAX_ROWS:
        from roofline.kernels import mixed_gemm

        if mixed_gemm.supports(kind, x, layer.qweight, layer.scales):
            cfg = mixed_gemm.pick_config(kind, x.shape[0], n, k, x.device)
            if cfg is None:  # measured: dequantize + cuBLAS is faster at this shape and M
                return kernels.dequant_cublas_gemm(
                    kind, x, layer.qweight, layer.scales, offsets, bias
                )
            x = x.contiguous()
            return mixed_gemm.mixed_gemm(
                kind, x, layer.qweight, layer.scales, offsets, bias, config=cfg
            )
    if x.shape[0] <= fused_max_rows(n * k):
        return kernels.dequant_gemm(
            kind, x.contiguous(), layer.qweight, layer.scales, offsets, bias
        )
    return kernels.dequant_cublas_gemm(kind, x, layer.qweight, layer.scales, offsets, bias)


def quantized_warmup_rows(model: nn.Module, max_rows: int) -> list[int]:
    """Row counts whose prefill forwards, at start-up, compile every GEMM kernel a quantized
    model's eager steps can reach beyond the decode sizes: the top of each row bucket of the
    ``wo_gemm`` and ``mixed_gemm`` tables above ``DECODE_MAX_ROWS`` (a kernel's specialization
    is per bucket: the row count itself is not specialized), then ``max_rows`` (dequantize +
    cuBLAS past the tables). Empty for a model without quantized linear layers. Without them,
    the first step in a new bucket compiled mid-run: H100, 8B int4, the default preset's first
    run 13.95 s against 12.46 warm; int8, the short preset's 13.79 against 13.22."""
    if not any(getattr(m, "qweight", None) is not None for m in model.modules()):
        return []
    from roofline.kernels import mixed_gemm_configs, wo_gemm_configs

    buckets = set(wo_gemm_configs.M_BUCKETS) | set(mixed_gemm_configs.M_BUCKETS) | {max_rows}
    return sorted(b for b in buckets if DECODE_MAX_ROWS < b <= max_rows)


def wo_candidates(
    kind: str, layer: nn.Module, dtype: torch.dtype
) -> tuple[tuple[str, torch.Tensor | None], ...]:
    """The ``wo_gemm`` table kinds a layer tries for x of ``dtype``, in order, with the offsets
    each passes: a symmetric int4 layer (offsets ``-8 s``) whose scales are of ``dtype`` its
    ``int4s`` entries without offsets first, then every layer its own kind's with its offsets."""
    own = ((kind, getattr(layer, "offsets", None)),)
    if getattr(layer, "int4_symmetric", False) and layer.scales.dtype == dtype:
        return (("int4s", None),) + own
    return own


def silu_out_choice(
    kind: str, layer: nn.Module, x: torch.Tensor
) -> tuple[object, torch.Tensor | None] | None:
    """(config, offsets) of the warp-specialized ``wo_gemm`` that takes this merged
    ``[gate; up]`` layer's GEMM with the SiLU-and-mul in its epilogue, or None: CUDA (Hopper),
    more than ``DECODE_MAX_ROWS`` rows, and either a ``WO_SILU_CONFIGS`` entry for the layer's
    shape and row count or a ``WO_CONFIGS`` pick (``quantized_linear``'s) that is that form;
    symmetric int4 tries its own entries first (shapes only, no sync)."""
    if not (USE_WO_SILU and USE_WO_GEMM and x.is_cuda and x.dim() == 2):
        return None
    if x.shape[0] <= DECODE_MAX_ROWS or kind not in ("int8", "int4", "fp8"):
        return None
    from roofline.kernels import wo_gemm

    n, k, m = layer.qweight.shape[0], x.shape[1], x.shape[0]
    if n % 2:
        return None

    def fits(cfg) -> bool:
        return wo_gemm.supports(kind, x, layer.qweight, layer.scales, cfg)

    candidates = wo_candidates(kind, layer, x.dtype)
    for name, offs in candidates:  # entries measured faster than the unfused pair
        cfg = wo_gemm.pick_silu(name, m, n, k)
        if cfg is not None and fits(cfg):
            return cfg, offs
    for name, offs in candidates:  # the first table pick decides, as in quantized_linear
        cfg = wo_gemm.pick(name, m, n, k)
        if cfg is not None:
            return (cfg, offs) if cfg.ws == 1 and fits(cfg) else None
    return None


def silu_mul_out_linear(
    kind: str, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``silu(x W_gate^T) * (x W_up^T)`` by ``silu_out_choice``'s kernel (the caller checked)."""
    from roofline.kernels.wo_gemm_ws import wo_gemm_ws

    choice = silu_out_choice(kind, layer, x)
    assert choice is not None, "silu_mul_out_linear without silu_out_choice"
    cfg, offsets = choice
    return wo_gemm_ws(kind, x, layer.qweight, layer.scales, offsets, bias, cfg, silu_mul=True)


def fuses_silu_mul(layer: nn.Module, gate_up: torch.Tensor) -> bool:
    """The fused dequant GEMM takes the SiLU-and-mul at one row on CUDA (as the 16-bit path)."""
    from roofline.layers import linear as linear_mod

    return (
        gate_up.is_cuda
        and gate_up.shape[0] <= linear_mod.SILU_MUL_MAX_ROWS
        and gate_up.dtype in (torch.bfloat16, torch.float16)
        and gate_up.is_contiguous()
    )


def silu_mul_linear(
    kind: str, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from roofline.kernels.dequant_gemm import dequant_gemm

    offsets = getattr(layer, "offsets", None)
    words = getattr(layer, "gemv_words", None)
    if words is not None:
        from roofline.kernels import int4_gemv
        from roofline.kernels.activation import silu_and_mul

        bits = layer.gemv_bits
        fused = gemv_fuses_silu(layer)
        x = gate_up if fused else silu_and_mul(gate_up)
        if int4_gemv.supports(x, words, layer.gemv_group, silu_mul=fused, bits=bits):
            return int4_gemv.int4_gemv(x, words, layer.gemv_pairs, bias, silu_mul=fused, bits=bits)
    if USE_QUANT_GEMV:
        from roofline.kernels import quant_gemv

        if quant_gemv.supports(kind, gate_up, layer.qweight, layer.scales, silu_mul=True):
            return quant_gemv.quant_gemv(
                kind, gate_up, layer.qweight, layer.scales, offsets, bias, silu_mul=True
            )
    return dequant_gemm(kind, gate_up, layer.qweight, layer.scales, offsets, bias, silu_mul=True)


def prepare_kernel_layout(kind: str, layer: nn.Module, cuda_only: bool = True) -> None:
    """After loading: a CUDA int4 or int8 layer whose shape allows it gets
    ``gemv_words`` and ``gemv_pairs``, the repacked copies ``kernels.int4_gemv`` reads for decode
    batches (the canonical tensors stay for the larger batches: ``mixed_gemm`` and dequantize +
    cuBLAS read them), ``gemv_bits`` and ``gemv_group``;
    a per-channel int8 layer gets its own ``qweight`` and its scales as ``[N]`` (views, no
    copy; ``INT8_GEMV_PLANES``: the repacked planes instead);
    an fp8 layer gets its own ``qweight`` and fp32 ``scales`` as they are (no copy).
    ``cuda_only=False`` makes them on any device (the interpreter's tests)."""
    layer.gemv_words = None
    use = {"int4": USE_INT4_GEMV, "int8": USE_INT8_GEMV, "fp8": USE_FP8_GEMV}.get(kind, False)
    if not use or (cuda_only and not layer.qweight.is_cuda):
        return
    from roofline.kernels import int4_gemv

    if kind == "fp8":
        k = layer.qweight.shape[1]
        scales = layer.scales
        if k % int4_gemv.TILE_K or scales.shape != (layer.qweight.shape[0],):
            return
        layer.gemv_words, layer.gemv_pairs = layer.qweight, scales.float().contiguous()
        layer.gemv_bits, layer.gemv_group = 8, k
        return
    if layer.scales.dim() != 2:
        return
    bits = 4 if kind == "int4" else 8
    k = layer.qweight.shape[1] * (2 if bits == 4 else 1)
    group = k // layer.scales.shape[1]
    if not int4_gemv.can_repack(k, group):
        return
    if kind == "int8" and group == k and not INT8_GEMV_PLANES:  # per channel: as they are
        # plain tensors over the parameters' storage (not registered as parameters themselves)
        layer.gemv_words = layer.qweight.detach()
        layer.gemv_pairs = layer.scales.detach().reshape(-1)
        layer.gemv_bits, layer.gemv_group = bits, group
        return
    canonical = CANONICAL_GEMV or (INT4_GEMV_CANONICAL and kind == "int4")
    with torch.no_grad():
        if canonical and group % int4_gemv.TILE_K == 0:  # as they are
            layer.gemv_words = layer.qweight.detach()
        else:
            repack = int4_gemv.repack_int4 if bits == 4 else int4_gemv.repack_int8
            layer.gemv_words = repack(layer.qweight)
        layer.gemv_pairs = _scale_operand(layer, bits)
    layer.gemv_bits, layer.gemv_group = bits, group


def _scale_operand(layer: nn.Module, bits: int) -> torch.Tensor:
    """What ``int4_gemv`` reads for a layer's scales: a symmetric int4 layer's (every offset
    ``-8 s``, checked exactly) ``[N, groups]`` scales themselves (no copy, half the bytes of
    pairs; ``ROOFLINE_INT4_GEMV_PAIRS=1`` keeps pairs), else ``pack_scales``' pairs."""
    from roofline.kernels import int4_gemv

    offsets = getattr(layer, "offsets", None)
    if bits == 4 and not INT4_GEMV_PAIRS and offsets is not None:
        if torch.equal(offsets, layer.scales * -8):
            return layer.scales.detach()
    return int4_gemv.pack_scales(layer.scales, offsets)


class CanonicalLinearMethod(LinearMethod):
    """A method whose weights sit in one canonical layout (``kind``: int8, int4 or fp8): its
    GEMM and its SiLU-fused down projection go through this module's kernel choice."""

    kind: str

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        prepare_kernel_layout(self.kind, layer)
        if self.kind == "int4" and layer.qweight.is_cuda:  # kernels.wo_gemm's symmetric form
            s, o = layer.scales, layer.offsets
            half = s.dtype in (torch.bfloat16, torch.float16)
            layer.int4_symmetric = half and torch.equal(o, s * -8)

    def weight_bytes(self, layer: nn.Module) -> int:
        """A repacked layer's decode reads its kernel copy (the same bytes as the canonical
        tensors, int8's zero offsets aside)."""
        if getattr(layer, "gemv_words", None) is None:
            return super().weight_bytes(layer)
        tensors = {id(t): t for t in (layer.gemv_words, layer.gemv_pairs)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quantized_linear(self.kind, layer, x, bias)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        return fuses_silu_mul(layer, gate_up)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return silu_mul_linear(self.kind, layer, gate_up, bias)

    def fuses_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return silu_out_choice(self.kind, layer, x) is not None

    def apply_silu_mul_out(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return silu_mul_out_linear(self.kind, layer, x, bias)
