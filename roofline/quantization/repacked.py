"""int4 / int8 linears on CUDA that keep only the repacked copy ``kernels.int4_gemv`` reads.

``common.prepare_kernel_layout`` repacks a CUDA int4 or int8 weight for the decode GEMV; the
canonical tensors (``formats``) then serve only the larger batches (``kernels.mixed_gemm``, or
dequantize + cuBLAS). Where the repacked copy can serve those as well at no measured loss,
``release_canonical`` drops the canonical tensors, halving the layer's weight memory:

* up to ``int4_gemv.MAX_ROWS`` rows: ``int4_gemv`` (its measured config, else its heuristic);
* up to ``int4_gemv.TILED_MAX_ROWS`` rows: ``int4_gemv`` in row tiles where its table has a
  config for M's bucket; where it has None (or ``mixed_gemm``'s table chose dequantize + cuBLAS)
  the repacked copy is dequantized into cuBLAS as below;
* more rows (prefill): ``int4_gemv_tiles.dequantize_words`` (one launch, the 16-bit weight of
  ``formats.dequantize_*``), then cuBLAS.

A layer is released only when ``serves_every_batch``: for each row-tile bucket the int4_gemv
table has an entry (row tiles, or None: dequantize the repack; ``scripts/gpu_gemv8.py`` enters
the faster of the two where it measured within 3% of today's ``mixed_gemm`` path or faster) or
the mixed table chose dequantize + cuBLAS. fp8 keeps one copy anyway (its kernel reads the
canonical weight), and the CPU keeps the canonical tensors (its kernels read them).
``ROOFLINE_QUANT_KEEP_CANONICAL=1`` keeps both copies everywhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

RELEASE = os.environ.get("ROOFLINE_QUANT_KEEP_CANONICAL", "0") != "1"
ROW_TILE_BUCKETS = (32, 64, 128, 256)


def _shape(layer: nn.Module) -> tuple[int | str, int, int, int]:
    """(table format, N, K, group) of a layer's repacked weight."""
    from roofline.kernels import int4_gemv

    words = layer.gemv_words
    fmt = int4_gemv.table_format(words, layer.gemv_bits)
    return fmt, words.shape[0], int4_gemv.weight_k(words, layer.gemv_bits), layer.gemv_group


def serves_every_batch(kind: str, layer: nn.Module) -> bool:
    """Whether the repacked copy serves every batch size at no measured loss (module doc)."""
    from roofline.kernels import int4_gemv
    from roofline.kernels.mixed_gemm_configs import TUNED_CONFIGS as MIXED

    fmt, n, k, group = _shape(layer)
    for bucket in ROW_TILE_BUCKETS:
        if MIXED.get((kind, n, k, bucket), ()) is None:
            continue  # dequantize + cuBLAS there: the same from the repacked copy
        if (fmt, n, k, group, bucket) not in int4_gemv.TUNED_CONFIGS:
            return False
    return True


def release_canonical(kind: str, layer: nn.Module, cuda_only: bool = True) -> bool:
    """Drop a repacked CUDA int4 / int8 layer's canonical tensors where ``serves_every_batch``;
    whether it did. Its forwards then go through ``repacked_linear`` (``cuda_only=False``: on
    any device, for the interpreter's tests)."""
    words = getattr(layer, "gemv_words", None)
    if not RELEASE or kind not in ("int4", "int8") or words is None:
        return False
    if cuda_only and not words.is_cuda:
        return False
    if not serves_every_batch(kind, layer):
        return False
    layer.qweight = None
    layer.scales = None
    if getattr(layer, "offsets", None) is not None:
        layer.offsets = None
    layer.canonical_released = True
    return True


def repacked_linear(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, N]
    """``x @ W^T + bias`` from the repacked copy alone (module doc)."""
    from roofline.kernels import int4_gemv, num_sms
    from roofline.kernels.int4_gemv_tiles import dequantize_words

    words, pairs, bits = layer.gemv_words, layer.gemv_pairs, layer.gemv_bits
    m = x.shape[0]
    if m <= int4_gemv.TILED_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        _, n, k, group = _shape(layer)
        cfg = int4_gemv.pick_config(n, k, group, m, x.device, bits)
        if cfg is None and m <= int4_gemv.MAX_ROWS:  # the table preferred quant_gemv (gone)
            cfg = int4_gemv.heuristic_config(n, k, group, m, num_sms(x.device))
        if cfg is not None:
            return int4_gemv.int4_gemv(x.contiguous(), words, pairs, bias, bits=bits, config=cfg)
    return F.linear(x, dequantize_words(words, pairs, bits, x.dtype), bias)
