"""GGUF weights kept in their Q4_0 / Q4_1 / Q8_0 blocks on the CPU, multiplied by the fused
dequantize-dot kernels of :mod:`roofline.kernels.cpu`.

:class:`GGUFCPUConfig` is built from a GGUF file's cached index: a linear layer whose every
checkpoint tensor has a type the CPU kernels read gets a :class:`GGUFBlocksLinearMethod`, any
other layer the 16-bit/fp32 path (its tensors then arrive dequantized). A tied LM head is
quantized too: it reads the embedding's own blocks (for the embedded SmolLM2: 30 MB of Q8_0
instead of 113 MB of fp32 per token). :func:`iter_gguf_kept` yields the checkpoint for such a
model: each kept tensor as its stored bytes, a uint8 ``[rows, row_bytes]`` view of the memory-
mapped file (llama's Q/K rows reordered as whole block rows), everything else as float32. The
method keeps one pointer per output row into those bytes: loading copies nothing, and pages are
read from the file as the first forward touches them.

A float tensor given to a Q8_0 layer (a tied head filled from a float embedding) is quantized
to Q8_0 on the way in; requantizing weights that were Q8_0 reproduces their blocks exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from roofline.kernels.cpu import ops
from roofline.models.gguf_index import GGUFIndex, gguf_index, tensor_bytes
from roofline.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    load_bias,
    shard_offset,
)

KEPT_TYPES = frozenset(ops.GGUF_FORMATS)
"""GGUF tensor types the CPU kernels read in place."""

_PACKED = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "o_proj": ("attn_output",),
    "down_proj": ("ffn_down",),
}


class GGUFBlocksLinearMethod(LinearMethod):
    """A linear layer over GGUF blocks of one type (``fmt``), read where they lie."""

    def __init__(self, fmt: str) -> None:
        if fmt not in KEPT_TYPES:
            raise ValueError(f"no CPU kernel for GGUF type {fmt} (have {sorted(KEPT_TYPES)})")
        self.fmt = fmt

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        if in_features % ops.QK:
            raise ValueError(f"GGUF blocks need in_features divisible by {ops.QK}")
        layer.gguf_parts = [None] * len(output_sizes)  # uint8 [rows, row_bytes] per shard
        layer.gguf_rows = None

    def _row_bytes(self, layer: nn.Module) -> int:
        return layer.in_features // ops.QK * ops.BLOCK_BYTES[self.fmt]

    def load(self, layer: nn.Module, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            load_bias(layer, shard, tensor)
            return
        if name != "weight":
            raise ValueError(f"a GGUF-block layer takes 'weight' and 'bias', not {name!r}")
        _, size = shard_offset(layer, shard)
        if tensor.is_floating_point():
            if self.fmt != "Q8_0":
                raise ValueError(f"float weights cannot be loaded into a {self.fmt} layer")
            tensor = quantize_q8_0(tensor)
        want = (size, self._row_bytes(layer))
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != want:
            raise ValueError(
                f"shard {shard}: expected {self.fmt} blocks uint8 {want}, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
        layer.gguf_parts[shard] = tensor

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if any(p is None for p in layer.gguf_parts):
            return  # not loaded (the model's completeness check names what is missing)
        parts = [(p, None) for p in layer.gguf_parts]
        layer.gguf_rows = ops.GGUFRows.from_tensors(self.fmt, layer.in_features, parts)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype
        b = None if bias is None else bias.float()
        y = ops.gguf_gemm(x, layer.gguf_rows, b)  # fp32
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def fuses_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        return gate_up.device.type == "cpu" and gate_up.dtype == torch.float32

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * in_features] -> [num_tokens, out_features] fp32
        b = None if bias is None else bias.float()
        return ops.gguf_gemm(gate_up, layer.gguf_rows, b, silu_mul=True)

    def weight_bytes(self, layer: nn.Module) -> int:
        return 0 if layer.gguf_rows is None else layer.gguf_rows.nbytes()


class GGUFRowsEmbedding(nn.Module):
    """A token embedding kept as GGUF block rows (the embedded SmolLM2's 30 MB of Q8_0 instead
    of 113 MB of fp32): a lookup dequantizes only the rows it needs. ``weight`` holds the rows'
    bytes, uint8 [vocab, row_bytes], which a tied LM head loads as its own blocks."""

    def __init__(self, fmt: str, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        if fmt not in KEPT_TYPES or embedding_dim % ops.QK:
            raise ValueError(f"no CPU kernel for a {fmt} embedding of width {embedding_dim}")
        self.fmt = fmt
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        row_bytes = embedding_dim // ops.QK * ops.BLOCK_BYTES[fmt]
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, row_bytes, dtype=torch.uint8), requires_grad=False
        )
        self._rows: ops.GGUFRows | None = None

    def rows(self) -> ops.GGUFRows:
        """The table as :class:`ops.GGUFRows` (row pointers into ``weight``)."""
        if self._rows is None or self._rows.sources[0].data_ptr() != self.weight.data_ptr():
            self._rows = ops.GGUFRows.from_tensors(
                self.fmt, self.embedding_dim, [(self.weight.data, None)]
            )
        return self._rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> fp32 [..., embedding_dim]
        out = ops.gguf_dequantize(self.rows(), input_ids.reshape(-1))
        return out.view(*input_ids.shape, self.embedding_dim)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> GGUF Q8_0 blocks uint8 [N, K / 32 * 34] (d = max|w| / 127 in fp16)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // ops.QK, ops.QK)  # [N, nb, 32]
    d = (w.abs().amax(dim=-1, keepdim=True) / 127).half()  # [N, nb, 1]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)  # [N, nb, 32]
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [N, nb, 34]
    return blocks.reshape(n, -1).contiguous()


class GGUFCPUConfig(QuantizationConfig):
    """Which linear layers of a GGUF model keep their blocks (see the module doc)."""

    name = "gguf"

    def __init__(self, path: str | Path) -> None:
        self.index: GGUFIndex = gguf_index(path)
        self.types = {t.name: t.type_name for t in self.index.tensors}

    def _layer_type(self, prefix: str) -> str | None:
        """The GGUF type all of the layer's tensors share, if the CPU kernels read it."""
        if prefix == "lm_head":
            names = ["output.weight" if "output.weight" in self.types else "token_embd.weight"]
        else:
            parts = prefix.split(".")  # model.layers.<i>.<self_attn|mlp>.<module>
            if len(parts) != 5 or parts[-1] not in _PACKED:
                return None
            names = [f"blk.{parts[2]}.{g}.weight" for g in _PACKED[parts[-1]]]
        kinds = {self.types.get(n) for n in names}
        kind = kinds.pop() if len(kinds) == 1 else None
        return kind if kind in KEPT_TYPES else None

    def get_linear_method(self, prefix: str) -> LinearMethod:
        kind = self._layer_type(prefix)
        return GGUFBlocksLinearMethod(kind) if kind else UnquantizedLinearMethod()

    def quantizes_lm_head(self) -> bool:
        return self._layer_type("lm_head") is not None

    def _embedding_type(self) -> str | None:
        """The embedding's type when the CPU kernels read it (rows of whole blocks)."""
        info = next((t for t in self.index.tensors if t.name == "token_embd.weight"), None)
        if info is None or info.type_name not in KEPT_TYPES or len(info.shape) != 2:
            return None
        return info.type_name if info.shape[1] % ops.QK == 0 else None

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module | None:
        kind = self._embedding_type()
        if kind is None or embedding_dim % ops.QK:
            return None
        return GGUFRowsEmbedding(kind, num_embeddings, embedding_dim)

    def keeps(self, hf_name: str) -> bool:
        """Whether the checkpoint tensor ``hf_name`` is yielded as its stored blocks."""
        if not hf_name.endswith(".weight"):
            return False
        if hf_name == "lm_head.weight":
            return self.quantizes_lm_head()
        if hf_name == "model.embed_tokens.weight":
            return self._embedding_type() is not None
        module = hf_name.removeprefix("model.").rsplit(".", 1)[0]  # layers.3.self_attn.q_proj
        parts = module.split(".")
        if len(parts) != 4:
            return False
        packed = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
        packed.update(gate_proj="gate_up_proj", up_proj="gate_up_proj")
        name = packed.get(parts[3], parts[3])
        return self._layer_type(f"model.layers.{parts[1]}.{parts[2]}.{name}") is not None


def iter_gguf_kept(config: GGUFCPUConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of a GGUF model under ``config``: kept tensors as uint8 block rows, the
    rest as float32 (HF names and dim order, llama's Q/K RoPE rows unpermuted)."""
    from roofline.models import gguf_loader

    index = config.index
    cfg = index.config
    arch = index.arch
    heads = {"q_proj": int(cfg["num_attention_heads"]), "k_proj": int(cfg["num_key_value_heads"])}
    for info in index.tensors:
        name = gguf_loader.hf_tensor_name(info.name)
        if name is None:
            continue
        data = tensor_bytes(index, info)
        if config.keeps(name):
            rows = info.shape[0]
            tensor = data.view(rows, info.num_bytes // rows)  # [rows, row_bytes]
        elif info.type_name in KEPT_TYPES and len(info.shape) == 2:
            rows = info.shape[0]
            blocks = ops.GGUFRows.from_tensors(
                info.type_name, info.shape[1], [(data.view(rows, -1), None)]
            )
            tensor = ops.gguf_dequantize(blocks)  # [rows, K] fp32 (the embedding)
        else:
            tensor = gguf_loader.dequantize_bytes(data, info)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if arch == "llama" and module in heads:
            tensor = gguf_loader.unpermute_rope_rows(tensor, heads[module])
        yield name, tensor
    if config.quantizes_lm_head() and "output.weight" not in config.types:
        info = next(t for t in index.tensors if t.name == "token_embd.weight")
        rows = info.shape[0]
        yield "lm_head.weight", tensor_bytes(index, info).view(rows, info.num_bytes // rows)


def cpu_gguf_checkpoint(
    path: str | Path, dummy: bool = False
) -> tuple[GGUFCPUConfig | None, Iterator[tuple[str, torch.Tensor]] | None]:
    """(config, weights) for running a GGUF file on the CPU with its blocks kept; (None, the
    dequantizing iterator) when no layer has a type the kernels read, and for random weights."""
    if dummy:
        return None, None
    config = GGUFCPUConfig(path)
    take_cores()
    if not any(t in KEPT_TYPES for t in config.types.values()):
        from roofline.models.weights import ModelSource, iter_weights

        return None, iter_weights(ModelSource("gguf", Path(path), ""))
    return config, iter_gguf_kept(config)


def take_cores() -> None:
    """Give the CPU to the kernels' thread pool: it runs every GEMM and decode step on all
    cores, and torch's intra-op pool drops to one thread. Two pools on the same cores fight:
    torch's OpenMP workers spin after each op while ours spin between GEMMs, and on the 2-core
    dev machine that turned a 0.1 ms decode attention into 22 ms (1.5 tok/s instead of 13 under
    load). The setting is process-wide because torch's is (there is no per-op or per-thread
    scope for its intra-op pool); what torch still runs on this path is sampling and the
    prefill's attention and norms. An application embedding the engine that wants torch's
    threads for its own work calls ``torch.set_num_threads`` after building it."""
    from roofline.kernels.cpu.build import load_library

    lib = load_library()
    if lib is not None and torch.get_num_threads() > 1:
        lib.rl_set_threads(torch.get_num_threads())
        torch.set_num_threads(1)
