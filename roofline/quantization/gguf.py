"""GGUF tensors kept quantized (``quantization="gguf"``): Q8_0, Q4_0 and Q4_1 blocks of 32 are
repacked exactly into the canonical int8 / int4 layouts with group 32 and fp16 scales:

* Q8_0 (34 bytes: fp16 ``d``, 32 int8): ``qweight = q``, ``scales = d``;
* Q4_0 (18 bytes: fp16 ``d``, 16 bytes; element ``j`` in the low nibble of byte ``j``, element
  ``j + 16`` in its high nibble): ``w = (q - 8) d``: ``scales = d``, ``offsets = -8 d``;
* Q4_1 (20 bytes: fp16 ``d``, fp16 ``m``, the same nibbles): ``w = q d + m``: ``offsets = m``.

Dequantizing the canonical tensors in fp32 gives the ``gguf`` package's values bit for bit
(``q d`` is exact in fp32, and ``-8 d`` too). A linear layer is kept quantized when all its
shards (q/k/v, gate/up) have one of these types, and the same one; others (Q4_K, Q6_K, ...) and
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

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
GGUF_GROUP = 32
_SHARDS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


def unpack_blocks(kind: str, data: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """Raw blocks (uint8 ``[rows, bytes]``) -> canonical (qweight, scales[, offsets])."""
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = torch.from_numpy(np.array(data, copy=True).reshape(rows, -1, block_bytes))
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
        return Int4LinearMethod(GGUF_GROUP, scale_dtype=torch.float16, prequantized=True)

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
