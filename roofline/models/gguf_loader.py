"""GGUF checkpoints (llama.cpp's format) read into HF terms: metadata to an HF ``config.json``-style
dict, tensors to float32 ``torch.Tensor``s under HF parameter names. Every quantization type the
``gguf`` package can dequantize is accepted. GGUF lists tensor dims innermost first, so a weight
of HF shape ``[out, in]`` is recorded as ``[in, out]``; the reader's numpy view is already in HF
order. llama.cpp's converter permutes the rows of the Q and K projections of the ``llama``
architecture from HF's rotate-half RoPE layout (pairs ``(j, j + head_dim/2)``) to an interleaved
one (pairs ``(2j, 2j + 1)``); :func:`unpermute_rope_rows` undoes it. ``qwen2``/``qwen3`` use
NeoX-style RoPE in llama.cpp, so their weights are stored unpermuted. Llama 3.x ``rope_freqs``
(per-frequency divisors written instead of ``rope_scaling`` metadata) are turned back into an HF
``llama3`` ``rope_scaling`` dict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from roofline.models.gguf_index import GGUFTensorInfo, gguf_index, tensor_bytes

GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
"""GGUF ``general.architecture`` -> (HF ``architectures[0]``, HF ``model_type``)."""

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router and the experts' weights stacked over the experts, [E, out, in] in HF order
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})
"""Tensors that are not parameters: ``rope_freqs`` is folded into ``rope_scaling``."""

_FLOAT_FILE_TYPES = {
    LlamaFileType.ALL_F32: "float32",
    LlamaFileType.MOSTLY_F16: "float16",
    LlamaFileType.MOSTLY_BF16: "bfloat16",
}
_MISSING = object()


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFReader:
    """A memory-mapped reader (cached: parsing the metadata of a large vocab takes a moment)."""
    try:
        return GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"not a readable GGUF file: {path} ({e})") from e


def gguf_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The decoded value of metadata ``key`` (str, number, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _f32_to_float(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for tensors that are not parameters."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_TENSORS:
        if parts[3] in ("weight", "bias"):
            return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}: no HF parameter name for it")


def gguf_config_dict(path: str | Path) -> dict[str, Any]:
    """An HF ``config.json``-style dict from GGUF metadata (usable as ``LlamaConfig(**d)``)."""
    reader = open_gguf(str(path))
    arch = str(gguf_field(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = _MISSING) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    # The token list is the vocab; llama.cpp pads it to the embedding rows, but if a file does
    # not, the embedding (GGUF dims [hidden, vocab]) decides, since that is what gets loaded.
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(meta("vocab_size"))
    embed_rows = int(tensors["token_embd.weight"].shape[-1])
    if embed_rows != vocab:
        vocab = embed_rows
    rope_theta = _f32_to_float(meta("rope.freq_base", 10000.0))
    eos_ids = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := gguf_field(reader, f"tokenizer.ggml.{key}", None)) is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
    file_type = gguf_field(reader, "general.file_type", None)
    # Quantized files dequantize to float32 here; bfloat16 (the range of the float32 training
    # weights) is the dtype to run them in.
    dtype = _FLOAT_FILE_TYPES.get(file_type, "bfloat16") if file_type is not None else "float32"
    d: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_to_float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, tensors, head_dim, rope_theta),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "torch_dtype": dtype,
        "_name_or_path": str(gguf_field(reader, "general.name", Path(path).stem)),
    }
    num_experts = int(meta("expert_count", 0) or 0)
    if num_experts:  # llama + experts is Mixtral; Qwen3-MoE renormalises its top-k as Mixtral
        if arch == "llama":
            d["architectures"], d["model_type"] = ["MixtralForCausalLM"], "mixtral"
        d["num_experts"] = num_experts
        d["num_experts_per_tok"] = int(meta("expert_used_count"))
        d["moe_intermediate_size"] = int(
            meta("expert_feed_forward_length", 0) or d["intermediate_size"]
        )
        d["norm_topk_prob"] = True
    return d


def _rope_scaling(
    reader: GGUFReader,
    arch: str,
    tensors: dict[str, ReaderTensor],
    head_dim: int,
    rope_theta: float,
) -> dict[str, Any] | None:
    kind = str(gguf_field(reader, f"{arch}.rope.scaling.type", "none"))
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor", None)
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": _f32_to_float(factor)}
    if kind == "yarn" and factor is not None:
        orig = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": _f32_to_float(factor),
            "original_max_position_embeddings": int(orig),
        }
    if kind not in ("none", "linear", "yarn"):
        raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" in tensors:
        divisors = dequantize_tensor(tensors["rope_freqs.weight"]).double()  # [head_dim // 2]
        return llama3_rope_scaling(divisors, head_dim, rope_theta)
    return None


def llama3_rope_divisors(
    head_dim: int,
    rope_theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Per-frequency divisors of Llama 3 RoPE scaling: ``inv_freq_scaled = inv_freq / divisor``.

    Wavelengths shorter than ``orig / high_freq_factor`` keep divisor 1, longer than
    ``orig / low_freq_factor`` get ``factor``; in between the inverse frequency is a linear blend
    ``(1 - s) * inv_freq / factor + s * inv_freq`` with ``s`` rising from 0 to 1.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # [head_dim // 2]
    wavelen = 2 * math.pi * rope_theta**exponents
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    divisors = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = torch.where(
        wavelen < original_max_position_embeddings / high_freq_factor, 1.0, divisors
    )
    return torch.where(
        wavelen > original_max_position_embeddings / low_freq_factor, factor, divisors
    )


def llama3_rope_scaling(divisors: torch.Tensor, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """Recover the HF ``llama3`` ``rope_scaling`` dict from llama.cpp's ``rope_freqs`` tensor.

    The tensor holds only the resulting divisors; ``factor`` is their maximum, and the band edges
    are matched against the values every Llama 3.1/3.2 release uses (low 1, high 4, original
    context 8192). A file whose divisors match nothing is refused rather than run with wrong RoPE.
    """
    factor = round(float(divisors.max()), 4)  # float32 noise off (8.000001 -> 8.0)
    for low, high, orig in ((1.0, 4.0, 8192),):
        expected = llama3_rope_divisors(head_dim, rope_theta, factor, low, high, orig)
        if expected.shape == divisors.shape and torch.allclose(expected, divisors, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise NotImplementedError(
        f"GGUF rope_freqs tensor (max {factor}) matches no known llama3 RoPE scaling"
    )


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: interleaved RoPE pairs back to rotate-half halves.

    Within each head, llama.cpp row ``2j + s`` holds HF row ``s * head_dim/2 + j``.
    ``weight`` is ``[num_heads * head_dim, ...]`` (a projection weight or its bias).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, half, 2, *rest)  # [heads, j, s, ...] in llama.cpp order
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()  # [heads, s, j, ...] HF order


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in HF dim order (quantized blocks expanded)."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize"
        ) from e
    if not array.flags.writeable:  # F32 tensors come back as a view of the read-only mmap
        array = array.copy()
    shape = [int(n) for n in reversed(tensor.shape)]
    return torch.from_numpy(array.astype(np.float32, copy=False)).reshape(shape)


def num_gguf_weights(path: str | Path) -> int:
    """How many tensors :func:`iter_gguf_weights` yields."""
    return sum(t.name not in _SKIPPED_TENSORS for t in gguf_index(path).tensors)


def iter_gguf_weights(
    path: str | Path, quant_config: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for each GGUF tensor, one at a time (read through
    the cached index and a memory map: the header is not parsed again). With a
    ``quantization.gguf.GGUFConfig``, the weights it keeps quantized come as their canonical
    ``qweight``/``scales``/``offsets`` tensors instead."""
    index = gguf_index(path)
    cfg = index.config
    arch = index.arch
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg["num_key_value_heads"])
    for info in index.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            heads = num_heads
        elif arch == "llama" and ".self_attn.k_proj." in name:
            heads = num_kv_heads

        def unpermute(t: torch.Tensor, heads: int | None = heads) -> torch.Tensor:
            return t if heads is None else unpermute_rope_rows(t, heads)

        kept = quant_config.kept(name) if quant_config is not None else None
        if kept is not None:
            from roofline.quantization.gguf import iter_kept

            data = tensor_bytes(index, info).numpy()
            yield from iter_kept(name, kept, data, int(info.shape[0]), unpermute)
            continue
        yield name, unpermute(dequantize_bytes(tensor_bytes(index, info), info))


def dequantize_bytes(data: torch.Tensor, info: GGUFTensorInfo) -> torch.Tensor:
    """A tensor's stored bytes (uint8 [num_bytes]) as float32 in HF dim order."""
    qtype = GGMLQuantizationType[info.type_name]
    try:
        array = dequantize(data.numpy(), qtype)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"GGUF tensor {info.name!r} has type {info.type_name}, which the gguf package "
            "cannot dequantize"
        ) from e
    array = np.array(array, dtype=np.float32, copy=True)  # own memory, never the file's map
    return torch.from_numpy(array).reshape(info.shape)


def gguf_chat_template(path: str | Path) -> str | None:
    """The Jinja chat template stored in the GGUF metadata, if any."""
    template = gguf_field(open_gguf(str(path)), "tokenizer.chat_template", None)
    return None if template is None else str(template)
