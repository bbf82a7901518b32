"""Decode steps of a Llama-family model on the CPU in one C call (``decoder.c``).

:func:`build_cpu_decoder` looks at a loaded model: on the CPU in fp32, one process (no tensor
parallelism), plain Llama layers (no MoE) whose every linear layer keeps GGUF blocks
(``quantization.gguf_cpu``), and the compiled library present, it returns a
:class:`CPUDecoder`; else None and the model runs its modules. The model calls the decoder for
decode-only steps (one query row per request) over an fp32 KV cache; prefill, chunked prefill,
verification steps and quantized KV pages keep the module path, which writes the same cache.
A mixed step is split (:meth:`CPUDecoder.split_step`): its one-row requests run here, the others
through the modules. The two paths round differently (the modules' RMSNorm, RoPE and attention
are torch's), so a request's row must take the same path whatever else is in its step: a
one-row request always runs here, or its greedy tokens would depend on the batch.
The decoder keeps one int64 table of the model's pointers (norm weights, each layer's GGUF row
pointers and formats, the layer's KV pages), rebuilt only when the KV tensors change, so a step
costs one ctypes call plus the arguments' addresses. ``ROOFLINE_CPU_DECODER=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from roofline.attention.metadata import AttentionMetadata
from roofline.kernels.cpu import ops
from roofline.kernels.cpu.build import load_library
from roofline.quantization.gguf_cpu import GGUFRowsEmbedding

if TYPE_CHECKING:
    from torch import nn

    from roofline.layers.attention import ForwardContext

LAYER_FIELDS = (
    "in_norm post_norm qkv_rows qkv_fmt qkv_bias o_rows o_fmt gu_rows gu_fmt down_rows down_fmt "
    "q_norm k_norm k_cache v_cache"
).split()
CONFIG_FIELDS = (
    "layers hidden heads kv_heads head_dim inter page act_bits isa vocab embed_fmt"
).split()


class CPUDecoder:
    """Runs ``model``'s decode steps in C; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        lib = load_library()
        assert lib is not None
        self.lib = lib
        if lib.rl_layer_field(-1) != len(LAYER_FIELDS) or lib.rl_config_fields() != len(
            CONFIG_FIELDS
        ):
            raise RuntimeError("decoder.c and decoder.py disagree on their tables")
        self.model = model
        cfg = model.config
        self.hidden_size = cfg.hidden_size
        self.eps = float(model.norm.eps)
        self._config_values = [
            cfg.num_hidden_layers,
            cfg.hidden_size,
            model.shard.num_heads,
            model.shard.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            0,  # page size: filled from the KV pages
            ops.ACT_BITS,
            len(ops.ISA_NAMES) - 1,
            model.embed_tokens.weight.shape[0],
            -1,  # the embedding's format: fp32 rows, or a GGUF code (set below)
        ]
        # the embedding's rows: fp32 [vocab, hidden], or GGUF blocks by row pointer
        embed = model.embed_tokens
        self._embed_rows = embed.rows() if isinstance(embed, GGUFRowsEmbedding) else None
        if self._embed_rows is not None:
            self._config_values[-1] = ops.GGUF_FORMATS[self._embed_rows.fmt]
        self._kv_key: tuple[int, ...] | None = None
        self._config = torch.empty(0, dtype=torch.int64)
        self._layers = torch.empty(0, dtype=torch.int64)

    def _tables(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        key = tuple(t.data_ptr() for kv in kv_caches for t in kv[:2])
        if key == self._kv_key:
            return
        rows = []
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            fields = {
                "in_norm": layer.input_layernorm.weight.data_ptr(),
                "post_norm": layer.post_attention_layernorm.weight.data_ptr(),
                "qkv_bias": 0 if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data_ptr(),
                "q_norm": 0 if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
                "k_norm": 0 if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
                "k_cache": k_cache.data_ptr(),
                "v_cache": v_cache.data_ptr(),
            }
            for name, linear in (
                ("qkv", attn.qkv_proj),
                ("o", attn.o_proj),
                ("gu", mlp.gate_up_proj),
                ("down", mlp.down_proj),
            ):
                fields[f"{name}_rows"] = linear.gguf_rows.row_ptrs.data_ptr()
                fields[f"{name}_fmt"] = ops.GGUF_FORMATS[linear.gguf_rows.fmt]
            rows.append([fields[n] for n in LAYER_FIELDS])
        self._layers = torch.tensor(rows, dtype=torch.int64)  # [num_layers, LAYER_FIELDS]
        values = list(self._config_values)
        values[CONFIG_FIELDS.index("page")] = kv_caches[0][0].shape[1]
        self._config = torch.tensor(values, dtype=torch.int64)
        self._kv_key = key

    def applies(self, ctx: ForwardContext) -> bool:
        """Whether this step is one the decoder runs (decode rows only, fp32 KV pages)."""
        kv = ctx.kv_caches[0]
        return ctx.meta.is_decode_only and len(kv) == 2 and kv[0].dtype == torch.float32

    def splits(self, ctx: ForwardContext) -> bool:
        """Whether a mixed step has one-row requests for the decoder (see :meth:`split_step`)."""
        meta, kv = ctx.meta, ctx.kv_caches[0]
        return (
            type(meta) is AttentionMetadata
            and meta.cascade is None
            and meta.uniform_query_len == 0
            and 1 in meta.query_lens_cpu
            and len(kv) == 2
            and kv[0].dtype == torch.float32
        )

    def split_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        modules: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor],
    ) -> torch.Tensor:
        """A mixed step in two parts: the requests of one query row (decodes, one-token chunks)
        here, as in a decode-only step, the others through ``modules`` (the model's own path),
        so each row gets the same bits whatever it is batched with. Requests own disjoint slots,
        so the order of the two parts does not matter."""
        # input_ids, positions: [num_tokens] -> final normed hidden states [num_tokens, hidden]
        meta = ctx.meta
        starts = meta.query_start_loc_cpu
        one = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        rest = [i for i, n in enumerate(meta.query_lens_cpu) if n != 1]
        one_rows = torch.tensor([starts[i] for i in one], dtype=torch.int64)  # [len(one)]
        rest_rows = torch.tensor(  # [num_tokens - len(one)]
            [t for i in rest for t in range(starts[i], starts[i + 1])], dtype=torch.int64
        )
        out = torch.empty(meta.num_tokens, self.hidden_size, dtype=torch.float32)
        out[one_rows] = self(
            input_ids[one_rows], positions[one_rows], replace(ctx, meta=_part(meta, one, one_rows))
        )
        if rest:
            part = replace(ctx, meta=_part(meta, rest, rest_rows))
            out[rest_rows] = modules(input_ids[rest_rows], positions[rest_rows], part).float()
        return out

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_reqs] -> final normed hidden states [num_reqs, hidden] fp32
        self._tables(ctx.kv_caches)
        meta = ctx.meta
        num_reqs = input_ids.shape[0]
        ids = input_ids if input_ids.dtype == torch.int64 else input_ids.long()
        pos = positions if positions.dtype == torch.int64 else positions.long()
        slots = (
            meta.slot_mapping
            if meta.slot_mapping.dtype == torch.int64
            else meta.slot_mapping.long()
        )
        seq_lens = meta.seq_lens.to(torch.int32)
        table = meta.block_table.to(torch.int32)
        if table.stride(1) != 1:
            table = table.contiguous()
        out = torch.empty(num_reqs, self.hidden_size, dtype=torch.float32)
        model = self.model
        status = self.lib.rl_decode_step(
            self._config.data_ptr(),
            self._layers.data_ptr(),
            (
                model.embed_tokens.weight.data_ptr()
                if self._embed_rows is None
                else self._embed_rows.row_ptrs.data_ptr()
            ),
            model.norm.weight.data_ptr(),
            model.rotary.cos_sin_cache.data_ptr(),
            self.eps,
            num_reqs,
            ids.contiguous().data_ptr(),
            pos.contiguous().data_ptr(),
            slots.contiguous().data_ptr(),
            seq_lens.contiguous().data_ptr(),
            table.data_ptr(),
            table.stride(0),
            out.data_ptr(),
        )
        if status == -2:
            raise IndexError(f"token id out of range of the embedding: {input_ids.tolist()}")
        if status != 0:
            raise MemoryError("the CPU decoder could not allocate its scratch buffers")
        return out


def build_cpu_decoder(model: nn.Module) -> CPUDecoder | None:
    """A :class:`CPUDecoder` for ``model`` where it applies (see the module docstring)."""
    if os.environ.get("ROOFLINE_CPU_DECODER", "1") == "0" or load_library() is None:
        return None
    from roofline.models.llama import LlamaAttention, LlamaMLP

    if model.parallel.is_parallel or model.embed_tokens.weight.device.type != "cpu":
        return None
    embed = model.embed_tokens
    fp32_table = type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.float32
    if not fp32_table and not isinstance(embed, GGUFRowsEmbedding):
        return None
    if model.config.rms_norm_eps != model.norm.eps:
        return None
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(getattr(m, "gguf_rows", None) is None for m in linears):
            return None
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None:
            return None
        if mlp.down_proj.bias is not None or attn.reduce is not None or mlp.reduce is not None:
            return None
        if attn.head_dim % 16 or attn.num_heads % attn.num_kv_heads:
            return None
        if attn.num_heads // attn.num_kv_heads > 64:  # decoder.c's per-group scratch
            return None
    return CPUDecoder(model)


def _part(meta: AttentionMetadata, reqs: list[int], rows: torch.Tensor) -> AttentionMetadata:
    """The metadata of requests ``reqs`` of a step alone (``rows``: their query rows)."""
    query_lens = [meta.query_lens_cpu[i] for i in reqs]
    seq_lens = [meta.seq_lens_cpu[i] for i in reqs]
    starts = [0, *accumulate(query_lens)]
    index = torch.tensor(reqs, dtype=torch.int64)
    return AttentionMetadata(
        num_reqs=len(reqs),
        num_tokens=len(rows),
        query_start_loc=torch.tensor(starts, dtype=meta.query_start_loc.dtype),
        seq_lens=meta.seq_lens[index],
        block_table=meta.block_table[index],
        slot_mapping=meta.slot_mapping[rows],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        page_size=meta.page_size,
        query_start_loc_cpu=starts,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
