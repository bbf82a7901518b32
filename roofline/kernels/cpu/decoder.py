"""Decode steps of a Llama-family model on the CPU in one C call (``decoder.c``).

:func:`build_cpu_decoder` looks at a loaded model: on the CPU in fp32, one process (no tensor
parallelism), plain Llama layers (no MoE) whose every linear layer keeps GGUF blocks
(``quantization.gguf_cpu``), and the compiled library present, it returns a
:class:`CPUDecoder`; else None and the model runs its modules. The decoder runs rows over an
fp32 KV cache (or fp16 pages, opt-in where its AVX-512 attention runs:
:meth:`CPUDecoder.wants_half_pages`),
each row one query over its request's pages up to its own position: decode rows,
and prompt rows at positions below ``PREFILL_POSITIONS`` (a short prompt's prefill: all its
rows' K/V are stored in a layer before any row of it attends, so each sees its own prefix).
Later rows of long prompts, verification steps, cascade metadata and quantized KV pages keep
the module path, which writes the same cache; a step with both kinds of rows is split
(:meth:`CPUDecoder.split_step`), the decoder's rows first. The two paths round differently
(the modules' RMSNorm, RoPE and attention are torch's), so which path a row takes depends on
its own request and position, not on the rest of the batch, or its greedy tokens would (one
exception: a one-token chunk of a long prompt, which the scheduler's token budget can cut,
runs here as a decode row).
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
from roofline.kernels.cpu.build import best_isa, load_library
from roofline.quantization.gguf_cpu import GGUFRowsEmbedding

if TYPE_CHECKING:
    from torch import nn

    from roofline.layers.attention import ForwardContext
    from roofline.quantization.kv_cache import KVCacheSpec

LAYER_FIELDS = (
    "in_norm post_norm qkv_rows qkv_fmt qkv_bias o_rows o_fmt gu_rows gu_fmt down_rows down_fmt "
    "q_norm k_norm k_cache v_cache"
).split()
PREFILL_POSITIONS = 128
"""Prompt rows at positions below this run in the decoder too, each as one decode row over its
own prefix (at most this many keys: cheap); later prompt rows of long prompts go through the
modules (torch's blocked attention), after the earlier rows of their chunk."""
CONFIG_FIELDS = (
    "layers hidden heads kv_heads head_dim inter page act_bits isa vocab embed_fmt kv_half"
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
            0,  # KV pages in fp16: filled from the KV pages
        ]
        # the embedding's rows: fp32 [vocab, hidden], or GGUF blocks by row pointer
        embed = model.embed_tokens
        self._embed_rows = embed.rows() if isinstance(embed, GGUFRowsEmbedding) else None
        if self._embed_rows is not None:
            self._config_values[CONFIG_FIELDS.index("embed_fmt")] = ops.GGUF_FORMATS[
                self._embed_rows.fmt
            ]
        head_dim = cfg.head_dim
        self.attention_isa_ok = (
            best_isa() == "avx512vnni" and head_dim % 16 == 0 and head_dim <= 256
        )
        """Whether decoder.c attends with its AVX-512 kernel (the one that reads fp16 pages)."""
        self.fp32_model = model.norm.weight.dtype == torch.float32
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
        values[CONFIG_FIELDS.index("kv_half")] = int(kv_caches[0][0].dtype == torch.float16)
        self._config = torch.tensor(values, dtype=torch.int64)
        self._kv_key = key

    def wants_half_pages(self, spec: KVCacheSpec) -> bool:
        """Whether the engine should keep this model's ``auto`` KV pages in fp16
        (``ROOFLINE_CPU_KV_HALF=1``, off by default): the decode attention reads every cached
        K/V row each step (at 32 requests x ~100 tokens, more bytes than the weights) and the
        AVX-512 kernel widens fp16 rows as it loads them: ~8% less CPU per token (+12% tok/s) on the
        32-prompt benchmark. Greedy tokens then stay those of the fp32 path on the 32 chat
        questions but not on every prompt (one of the three raw prompts of
        ``tests/e2e/test_cpu_gguf.py`` moves at token 5), so fp32 pages stay the default."""
        return (
            os.environ.get("ROOFLINE_CPU_KV_HALF", "0") == "1"
            and not spec.quantized
            and spec.model_dtype == torch.float32
            and self.attention_isa_ok
            and self.fp32_model
        )

    def _plain(self, ctx: ForwardContext) -> bool:
        """The plain metadata (no cascade, no verification rows) over fp32 KV pages, or the fp16
        ones of :meth:`wants_half_pages`."""
        meta, kv = ctx.meta, ctx.kv_caches[0]
        return (
            type(meta) is AttentionMetadata
            and meta.cascade is None
            and meta.uniform_query_len == 0
            and len(kv) == 2
            and (
                kv[0].dtype == torch.float32
                or (kv[0].dtype == torch.float16 and self.attention_isa_ok and self.fp32_model)
            )
        )

    def applies(self, ctx: ForwardContext) -> bool:
        """Whether every row of this step runs here: a decode-only step, or prompt rows all at
        positions below ``PREFILL_POSITIONS`` (see :meth:`_plain`)."""
        meta = ctx.meta
        if not self._plain(ctx):
            return False
        if meta.is_decode_only:
            return True
        return all(
            q == 1 or s <= PREFILL_POSITIONS for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu)
        )

    def splits(self, ctx: ForwardContext) -> bool:
        """Whether a step that does not run here whole has rows for the decoder (see
        :meth:`split_step`)."""
        meta = ctx.meta
        return self._plain(ctx) and any(
            q == 1 or s - q < PREFILL_POSITIONS
            for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu)
        )

    def split_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        modules: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor],
    ) -> torch.Tensor:
        """A step in two parts: the rows of one-row requests (decodes, one-token chunks) and
        prompt rows at positions below ``PREFILL_POSITIONS`` here, the later rows of longer
        chunks through ``modules`` (the model's own path) after them, whose attention then finds
        the earlier rows' K/V stored. Which path a row takes depends on its own request and
        position only, so each row gets the same bits whatever it is batched with."""
        # input_ids, positions: [num_tokens] -> final normed hidden states [num_tokens, hidden]
        meta = ctx.meta
        starts = meta.query_start_loc_cpu
        here: list[int] = []  # rows run here
        later: list[tuple[int, int]] = []  # (request, its first row for the modules)
        for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            first = starts[i] + (q if q == 1 else max(0, min(q, PREFILL_POSITIONS - (s - q))))
            here.extend(range(starts[i], first))
            if first < starts[i + 1]:
                later.append((i, first))
        here_rows = torch.tensor(here, dtype=torch.int64)  # [len(here)]
        out = torch.empty(meta.num_tokens, self.hidden_size, dtype=torch.float32)
        if here:
            part = replace(ctx, meta=_rows_part(meta, here_rows, positions[here_rows]))
            out[here_rows] = self(input_ids[here_rows], positions[here_rows], part)
        if later:
            rest_rows = torch.tensor(  # [num_tokens - len(here)]
                [t for i, first in later for t in range(first, starts[i + 1])], dtype=torch.int64
            )
            part = replace(ctx, meta=_tail_part(meta, later))
            out[rest_rows] = modules(input_ids[rest_rows], positions[rest_rows], part).float()
        return out

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Rows of a step that :meth:`applies` to (or a part that does): each row one C
        decode row over its request's pages up to its own position (prompt rows of a request
        see the rows before them, stored in the same layer before any row attends)."""
        # input_ids, positions: [num_rows] -> final normed hidden states [num_rows, hidden] fp32
        self._tables(ctx.kv_caches)
        meta = ctx.meta
        num_rows = input_ids.shape[0]
        ids = input_ids if input_ids.dtype == torch.int64 else input_ids.long()
        pos = positions if positions.dtype == torch.int64 else positions.long()
        slots = (
            meta.slot_mapping
            if meta.slot_mapping.dtype == torch.int64
            else meta.slot_mapping.long()
        )
        if meta.is_decode_only:  # one row per request
            seq_lens = meta.seq_lens.to(torch.int32)
            table = meta.block_table.to(torch.int32)
        else:  # each row attends to its own prefix: its request's pages up to its position
            seq_lens = (pos + 1).to(torch.int32)  # [num_rows]
            reqs = torch.repeat_interleave(  # [num_rows]: each row's request
                torch.arange(meta.num_reqs), torch.tensor(meta.query_lens_cpu)
            )
            table = meta.block_table.index_select(0, reqs).to(torch.int32)
        if table.stride(1) != 1:
            table = table.contiguous()
        out = torch.empty(num_rows, self.hidden_size, dtype=torch.float32)
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
            num_rows,
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
        if status == -3:
            raise RuntimeError("fp16 KV pages need the AVX-512 decode attention")
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


def _rows_part(
    meta: AttentionMetadata, rows: torch.Tensor, positions: torch.Tensor
) -> AttentionMetadata:
    """Some rows of a step (at ``positions``) as a decode-only step, each row a request of its
    own over its request's pages up to its position: what the decoder runs."""
    starts = meta.query_start_loc_cpu
    index = torch.bucketize(rows, torch.tensor(starts[1:]), right=True)  # [len(rows)]: requests
    seq_lens = positions.to(meta.seq_lens.dtype) + 1  # [len(rows)]
    num_rows = len(rows)
    return AttentionMetadata(
        num_reqs=num_rows,
        num_tokens=num_rows,
        query_start_loc=torch.arange(num_rows + 1, dtype=meta.query_start_loc.dtype),
        seq_lens=seq_lens,
        block_table=meta.block_table[index],
        slot_mapping=meta.slot_mapping[rows],
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        page_size=meta.page_size,
        query_start_loc_cpu=list(range(num_rows + 1)),
        query_lens_cpu=[1] * num_rows,
        seq_lens_cpu=seq_lens.tolist(),
    )


def _tail_part(meta: AttentionMetadata, later: list[tuple[int, int]]) -> AttentionMetadata:
    """The metadata of the requests in ``later`` alone, each from its row ``first`` to the end
    of its chunk (the rows before it already ran, their K/V stored)."""
    starts = meta.query_start_loc_cpu
    reqs = [i for i, _ in later]
    query_lens = [starts[i + 1] - first for i, first in later]
    seq_lens = [meta.seq_lens_cpu[i] for i in reqs]
    rows = torch.tensor(  # [sum(query_lens)]
        [t for i, first in later for t in range(first, starts[i + 1])], dtype=torch.int64
    )
    cum = [0, *accumulate(query_lens)]
    index = torch.tensor(reqs, dtype=torch.int64)
    return AttentionMetadata(
        num_reqs=len(reqs),
        num_tokens=len(rows),
        query_start_loc=torch.tensor(cum, dtype=meta.query_start_loc.dtype),
        seq_lens=meta.seq_lens[index],
        block_table=meta.block_table[index],
        slot_mapping=meta.slot_mapping[rows],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        page_size=meta.page_size,
        query_start_loc_cpu=cum,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
