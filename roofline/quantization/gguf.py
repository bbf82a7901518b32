"""GGUF tensors kept quantized (``quantization="gguf"``): Q8_0, Q4_0 and Q4_1 blocks of 32 are
repacked exactly into the canonical int8 / int4 layouts with group 32 and fp16 scales (Q4_K into
int4 with group 32 and Q6_K into int8 with group 16, with fp32 scales: see their unpackers):

* Q8_0 (34 bytes: fp16 ``d``, 32 int8): ``qweight = q``, ``scales = d``;
* Q4_0 (18 bytes: fp16 ``d``, 16 bytes; element ``j`` in the low nibble of byte ``j``, element
  ``j + 16`` in its high nibble): ``w = (q - 8) d``: ``scales = d``, ``offsets = -8 d``;
* Q4_1 (20 bytes: fp16 ``d``, fp16 ``m``, the same nibbles): ``w = q d + m``: ``offsets = m``.

Dequantizing the canonical tensors in fp32 gives the ``gguf`` package's values bit for bit
(``q d`` is exact in fp32, and ``-8 d`` too). A linear layer is kept quantized when all its
shards (q/k/v, gate/up) have one of these types, and the same one; other types and
the embedding and LM head keep today's dequantize-to-float path. This is not the default: on the
CPU the per-call dequantization changes the summation order of today's MKL-packed fp32 path, so
the default GGUF path stays dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from roofline.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from roofline.quantization.formats import pack_int4
from roofline.quantization.int4 import Int4LinearMethod
from roofline.quantization.int8 import Int8LinearMethod

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
GGUF_GROUP = 32
_SHARDS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


def unpack_blocks(kind: str, data: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """Raw blocks (uint8 ``[rows, bytes]``) -> canonical (qweight, scales[, offsets])."""
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}[kind]
    blocks = torch.from_numpy(np.array(data, copy=True).reshape(rows, -1, block_bytes))
    if kind == "Q4_K":
        return _unpack_q4_k(blocks, rows)
    if kind == "Q6_K":
        return _unpack_q6_k(blocks, rows)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [rows, G]
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)  # [rows, K]
        return q, d
    start = 2 if kind == "Q4_0" else 4
    nibbles = blocks[..., start:]  # [rows, G, 16]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, -1)  # [rows, K]
    if kind == "Q4_0":
        offsets = (-8.0 * d.float()).to(torch.float16)
    else:
        offsets = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    return pack_int4(q), d, offsets


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16)[..., 0].float()


def _unpack_q4_k(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """Q4_K super-blocks of 256 (fp16 ``d``, ``dmin``; 12 bytes of eight 6-bit scales and
    mins; 128 bytes of nibbles, each 32-byte run holding sub-block 2c in its low nibbles and 2c+1
    in its high ones): ``w = d sc q - dmin m`` -> int4 with group 32, fp32
    ``scales = d sc`` and ``offsets = -dmin m`` (both products exact in fp32)."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, B]
    packed = blocks[..., 4:16].reshape(rows, -1, 3, 4).int()  # [rows, B, 3, 4]
    lo, mid, hi = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [rows, B, 8]
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    scales = (d[..., None] * sc.float()).reshape(rows, -1)  # [rows, K / 32]
    offsets = -(dmin[..., None] * mn.float()).reshape(rows, -1)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # [rows, B, chunk, 32]
    q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(rows, -1)  # [rows, K]
    return pack_int4(q), scales, offsets


def _unpack_q6_k(blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    fp16 ``d``): ``w = d sc q`` with q in -32..31 -> int8 with group 16, fp32 ``scales = d sc``."""
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64)  # [rows, B, half, 1, 64]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, B, 16]
    d = _f16(blocks[..., 208:210])  # [rows, B]
    low = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3  # [rows, B, half, 4, 32]
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(rows, -1)
    return q, (d[..., None] * sc).reshape(rows, -1)


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, layer_types: dict[str, str]) -> None:
        self.layer_types = layer_types  # HF-style linear prefix -> kept GGUF type

    @classmethod
    def from_file(cls, path: str) -> GGUFConfig:
        from roofline.models.gguf_loader import open_gguf

        types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
        layer_types = {}
        for name in types:
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
                continue
            for module, shards in _SHARDS.items():
                if parts[2] != shards[0]:
                    continue
                kinds = {types.get(f"blk.{parts[1]}.{s}.weight") for s in shards}
                if len(kinds) == 1 and (kind := kinds.pop()) in KEPT_TYPES:
                    sub = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
                    layer_types[f"model.layers.{parts[1]}.{sub}.{module}"] = kind
        return cls(layer_types)

    def get_linear_method(self, prefix: str) -> LinearMethod:
        kind = self.layer_types.get(prefix)
        if kind is None:
            return UnquantizedLinearMethod()
        if kind == "Q8_0":
            return Int8LinearMethod(GGUF_GROUP, torch.float16, prequantized=True)
        if kind == "Q6_K":
            return Int8LinearMethod(16, torch.float32, prequantized=True)
        scale_dtype = torch.float32 if kind == "Q4_K" else torch.float16
        return Int4LinearMethod(GGUF_GROUP, scale_dtype=scale_dtype, prequantized=True)

    def kept(self, hf_weight_name: str) -> str | None:
        """The kept type of an HF weight name (``...q_proj.weight``), else None."""
        from roofline.models.llama import PACKED_MODULES

        parts = hf_weight_name.split(".")
        if parts[-1] != "weight" or len(parts) < 3:
            return None
        module = PACKED_MODULES.get(parts[-2], (parts[-2], 0))[0]
        return self.layer_types.get(".".join(parts[:-2] + [module]))


def iter_kept(
    name: str, kind: str, data: np.ndarray, rows: int, unpermute
) -> Iterator[tuple[str, torch.Tensor]]:
    """The canonical tensors of one kept GGUF weight under ``<module>.qweight`` etc."""
    module = name.removesuffix(".weight")
    tensors = unpack_blocks(kind, data, rows)
    for suffix, t in zip(("qweight", "scales", "offsets"), tensors):
        yield f"{module}.{suffix}", unpermute(t)
