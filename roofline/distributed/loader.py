"""Each rank's weights, read as slices: from safetensors only the bytes of this rank's slice
(``safe_open(...).get_slice``), so no rank materialises the whole model; GGUF tensors (which
come dequantized, whole) and random "dummy" weights are sliced after they are made.

Random weights under tensor parallelism are drawn per checkpoint tensor at full size from a
generator seeded by the tensor's name, then sliced, so every rank (and a TP = 1 run through the
same function) sees one and the same model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from safetensors import safe_open

from roofline.config import ModelConfig
from roofline.distributed.expert_parallel import parse_expert_tensor
from roofline.distributed.sharding import ShardLayout, TensorSlice, weight_slice
from roofline.models.weights import ModelSource, _safetensors_files, iter_weights
from roofline.quantization.base import LinearMethod, QuantizationConfig

PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
PACKED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def iter_sharded_weights(
    source: ModelSource,
    cfg: ModelConfig,
    layout: ShardLayout,
    quant_config: QuantizationConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, this rank's slice)`` for every checkpoint tensor of ``source``. A tensor of
    a linear layer whose quantization method overrides ``shard_slice`` is read whole and cut
    by that method; every other tensor is cut by its role and shape (``ShardLayout``)."""
    if source.kind == "hf":
        for file in _safetensors_files(source.path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if not layout.keeps(name):
                        continue  # another rank's expert: never read
                    method = _own_slicer(quant_config, name)
                    if method is not None:
                        yield name, _method_slice(method, name, f.get_tensor(name), cfg, layout)
                        continue
                    part = f.get_slice(name)
                    shape = tuple(part.get_shape())
                    sl = layout.slice_of(name, shape, cfg.head_dim)
                    yield name, _read_slice(part, shape, sl)
        return
    for name, tensor in iter_weights(source):
        if not layout.keeps(name):
            continue
        method = _own_slicer(quant_config, name)
        if method is not None:
            yield name, _method_slice(method, name, tensor, cfg, layout)
        else:
            sl = layout.slice_of(name, tuple(tensor.shape), cfg.head_dim)
            yield name, apply_slice(tensor, sl)


def _own_slicer(quant_config: QuantizationConfig | None, name: str) -> LinearMethod | None:
    """The method of ``name``'s linear layer when it slices its own tensors, else None."""
    if quant_config is None:
        return None
    parts = name.removeprefix("model.").split(".")
    if len(parts) < 2 or parts[0] not in ("layers", "lm_head"):
        return None  # embeddings and final norm: never a quantized linear's tensors
    if parse_expert_tensor(name) is not None:
        return None  # experts: sliced by the layout, quantized by the layer's MoE method
    module = PACKED.get(parts[-2], parts[-2])
    prefix = ".".join(["model", *parts[:-2], module] if parts[0] == "layers" else parts[:-1])
    method = quant_config.get_linear_method(prefix)
    if type(method).shard_slice is LinearMethod.shard_slice:
        return None
    return method


def _method_slice(
    method: LinearMethod, name: str, tensor: torch.Tensor, cfg: ModelConfig, layout: ShardLayout
) -> torch.Tensor:
    where = weight_slice(layout, name, cfg)
    if where is None:
        return tensor
    axis, start, size = where
    return method.shard_slice(name.rsplit(".", 1)[-1], tensor, axis, start, size).contiguous()


def _read_slice(part, shape: tuple[int, ...], sl: TensorSlice | None) -> torch.Tensor:
    if sl is None:
        return part[:]
    index = [slice(None)] * len(shape)
    index[sl.dim] = slice(sl.start, sl.start + sl.length)
    return _pad(part[tuple(index)], sl)


def apply_slice(tensor: torch.Tensor, sl: TensorSlice | None) -> torch.Tensor:
    if sl is None:
        return tensor
    return _pad(tensor.narrow(sl.dim, sl.start, sl.length).contiguous(), sl)


def _pad(t: torch.Tensor, sl: TensorSlice) -> torch.Tensor:
    if sl.length == sl.padded_length:
        return t
    shape = list(t.shape)
    shape[sl.dim] = sl.padded_length - sl.length  # vocab rows past the end: zeros
    return torch.cat([t, t.new_zeros(shape)], dim=sl.dim)


def dummy_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of a random model of ``cfg``, under HF names, with its shape
    (MoE layers: the router and per-expert tensors, Qwen3-MoE's names)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        mlp: tuple[tuple[str, tuple[int, int]], ...] = (
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        )
        if cfg.num_experts and layer not in cfg.dense_mlp_layers:
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            per_expert = (("gate_proj", (mi, h)), ("up_proj", (mi, h)), ("down_proj", (h, mi)))
            mlp = (("mlp.gate", (e, h)),) + tuple(
                (f"mlp.experts.{x}.{proj}", shape) for x in range(e) for proj, shape in per_expert
            )
        for name, shape in (
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            *mlp,
        ):
            shapes[p + name + ".weight"] = shape
        if cfg.attention_bias:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def dummy_checkpoint(
    cfg: ModelConfig,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    std: float = 0.02,
    layout: ShardLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint under HF names, one full tensor at a time: N(0, std) matrices, unit
    norms, zero biases (as ``init_dummy_weights``), each tensor from its own name's seed; the
    tensors ``layout`` does not keep (other ranks' experts) are not drawn."""
    for name, shape in dummy_shapes(cfg).items():
        if layout is not None and not layout.keeps(name):
            continue
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "big")
            gen = torch.Generator(device=device).manual_seed(key)
            t = torch.empty(shape, dtype=dtype, device=device)
            yield name, t.normal_(0.0, std, generator=gen)


def iter_dummy_sharded(
    cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device, layout: ShardLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in dummy_checkpoint(cfg, seed, dtype, device, layout=layout):
        yield name, apply_slice(tensor, layout.slice_of(name, tuple(tensor.shape), cfg.head_dim))
