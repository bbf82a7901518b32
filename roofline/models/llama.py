"""The Llama family: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, SmolLM2, and the Qwen2
(q/k/v bias) and Qwen3 (per-head q/k RMSNorm) variants, which differ only by two flags.

Checkpoint names follow HF; ``q/k/v_proj`` load into the packed ``qkv_proj`` and
``gate/up_proj`` into ``gate_up_proj`` (see ``PACKED_MODULES``).

Under tensor parallelism (a ``ParallelContext`` of ``world_size > 1``) every layer is built with
its rank's local sizes (``distributed/sharding.py``: heads, KV heads, MLP columns, vocabulary
rows), the loader hands it its slices, and the row-parallel outputs (o_proj, down_proj) and the
vocab-parallel embedding are all-reduced; logits are gathered over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from roofline.config import ModelConfig
from roofline.distributed.layers import VocabParallelEmbedding
from roofline.distributed.parallel_state import SINGLE, ParallelContext
from roofline.distributed.sharding import ShardLayout
from roofline.layers import fused_decode
from roofline.layers.activation import SiluAndMul
from roofline.layers.attention import Attention, ForwardContext
from roofline.layers.linear import Linear, MergedLinear, linear, mkl_prepack
from roofline.layers.norm import RMSNorm
from roofline.layers.rotary import RotaryEmbedding
from roofline.quantization.base import LinearMethod, QuantizationConfig

if TYPE_CHECKING:
    from roofline.kernels.cpu.decoder import CPUDecoder

# checkpoint module name -> (packed module name, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def linear_method(quant_config: QuantizationConfig | None, prefix: str) -> LinearMethod | None:
    """The method of the linear layer at ``prefix`` (None: 16-bit, the layer's default)."""
    return None if quant_config is None else quant_config.get_linear_method(prefix)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard: ShardLayout | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        shard = shard or ShardLayout.of(cfg, 0, 1)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias=cfg.attention_bias,
            method=linear_method(quant_config, f"{prefix}qkv_proj"),
        )
        self.o_proj = Linear(
            self.q_size, cfg.hidden_size, method=linear_method(quant_config, f"{prefix}o_proj")
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # shared by all layers, not owned
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)
        self.reduce = parallel.all_reduce if parallel.is_parallel else None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        ctx: ForwardContext,
        input_norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # With input_norm and residual (layers/fused_decode.py), x is the residual stream: the
        # norm runs inside the qkv GEMM and the result is residual + o_proj(attention).
        num_tokens = x.shape[0]
        if input_norm is not None:
            qkv = fused_decode.norm_linear(self.qkv_proj, input_norm, x)
        else:
            qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            if self.attn.fuses_rope(q, ctx):  # normalised inside the backend's RoPE + store
                qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, ctx, positions, self.rotary, qk_norm)  # RoPE, store, attention
        if residual is not None:
            return fused_decode.linear_add(self.o_proj, out, residual)  # [num_tokens, hidden]
        out = self.o_proj(out)  # [num_tokens, hidden] (this rank's partial sum under TP)
        return out if self.reduce is None else self.reduce(out)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard: ShardLayout | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        i = cfg.intermediate_size if shard is None else shard.intermediate_size
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, [i, i], method=linear_method(quant_config, f"{prefix}gate_up_proj")
        )
        self.down_proj = Linear(
            i, cfg.hidden_size, method=linear_method(quant_config, f"{prefix}down_proj")
        )
        self.act = SiluAndMul()
        self.reduce = parallel.all_reduce if parallel.is_parallel else None

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if norm is not None and residual is not None:  # fused decode: x is the residual stream
            return fused_decode.mlp_norm_add(self.gate_up_proj, self.down_proj, norm, x, residual)
        if self.gate_up_proj.fuses_silu_mul_out(x):  # the SiLU-and-mul in gate_up's epilogue
            out = self.down_proj(self.gate_up_proj.forward_silu_mul_out(x))
            return out if self.reduce is None else self.reduce(out)
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.down_proj.fuses_silu_mul(gate_up):  # batch-1 decode: SiLU inside the down GEMM
            out = self.down_proj.forward_silu_mul(gate_up)
        else:
            out = self.down_proj(self.act(gate_up))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        shard: ShardLayout | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}."
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(
            cfg, layer_idx, rotary, quant_config, f"{prefix}self_attn.", shard, parallel
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, quant_config, f"{prefix}mlp.", shard, parallel)
        self._fusable: bool | None = None  # fused_decode.layer_supports, decided at first use
        self._fp8_norms: tuple[bool, bool] | None = None  # norms that quantize for W8A8 GEMMs

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # residual None: x is the whole residual stream (after the embedding or a fused layer)
        if residual is None and x.shape[0] <= fused_decode.MAX_ROWS:
            if self._fusable is None:
                self._fusable = fused_decode.layer_supports(self)
            if self._fusable and fused_decode.applies(self, x):
                h = self.self_attn(positions, x, ctx, self.input_layernorm, residual=x)
                return self.mlp(h, self.post_attention_layernorm, residual=h), None
        if self._fp8_norms is None:
            from roofline.quantization.fp8 import fp8_norms

            self._fp8_norms = fp8_norms(self)
        fp8_in, fp8_post = self._fp8_norms
        if residual is None:
            residual = x
            x = self.input_layernorm(x, fp8=fp8_in)
        else:
            x, residual = self.input_layernorm(x, residual, fp8=fp8_in)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual, fp8=fp8_post)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack, its embedding and LM head. Linear layers get their method from
    ``quant_config`` (by HF-style prefix); the embedding stays 16-bit unless the config keeps it
    in the checkpoint's quantized rows (``QuantizationConfig.embedding``), and the LM head
    does too unless the config quantizes it (a tied head then gets its own quantized copy of
    the embedding, filled when loading ends)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        quant_config: QuantizationConfig | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        shard = ShardLayout.of(cfg, parallel.rank, parallel.world_size, parallel.expert_parallel)
        self.shard = shard
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max(max_positions, 1), cfg.rope_theta, cfg.rope_scaling
        )
        if parallel.is_parallel:
            self.embed_tokens = VocabParallelEmbedding(
                shard.vocab_per_rank, cfg.hidden_size, parallel
            )
        else:
            kept = quant_config and quant_config.embedding(cfg.vocab_size, cfg.hidden_size)
            # _weight skips the random init (on the meta device it imports torch._dynamo: 1.4 s)
            self.embed_tokens = kept or nn.Embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size),
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary, quant_config, shard, parallel)
            for i in range(cfg.num_hidden_layers)
        )
        head_rows = shard.vocab_per_rank if parallel.is_parallel else cfg.vocab_size
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        own_head = not cfg.tie_word_embeddings or (
            quant_config is not None and quant_config.quantizes_lm_head()
        )
        self.lm_head = (
            Linear(cfg.hidden_size, head_rows, method=linear_method(quant_config, "lm_head"))
            if own_head
            else None
        )
        self._tied_head_packed: torch.Tensor | None = None
        self.cpu_decoder: CPUDecoder | None = None
        """Runs decode-only steps in one C call, and a mixed step's one-row requests, where the
        model qualifies (GGUF blocks on the CPU: ``kernels/cpu/decoder.py``); None elsewhere."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        if self.cpu_decoder is not None and self.cpu_decoder.applies(ctx):
            return self.cpu_decoder(input_ids, positions, ctx)
        if self.cpu_decoder is not None and self.cpu_decoder.splits(ctx):  # one-row requests
            return self.cpu_decoder.split_step(input_ids, positions, ctx, self._forward_modules)
        return self._forward_modules(input_ids, positions, ctx)

    def _forward_modules(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        if residual is None:  # the last layer ran fused: x is the whole stream
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> [num_rows, vocab] fp32 (``upcast=False``: the head's
        # dtype, for callers that cast themselves only when they need to)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.embed_tokens.weight, None, self._tied_head_packed)
        if upcast:
            logits = logits.float()
        if self.parallel.is_parallel:  # [num_rows, vocab_per_rank] -> all ranks, padding cut
            logits = self.parallel.gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits

    def process_weights_after_loading(self) -> None:
        """Each linear method's post-load step (the 16-bit one: MKL-packed weights for batch-1
        decode on the CPU in fp32, a no-op elsewhere); the same for a tied LM head."""
        for module in self.modules():
            if isinstance(module, MergedLinear):
                module.process_weights_after_loading()
        if self.lm_head is None:
            self._tied_head_packed = mkl_prepack(self.embed_tokens.weight)
        if self.embed_tokens.weight.device.type == "cpu" and type(self).forward is (
            LlamaForCausalLM.forward
        ):
            from roofline.kernels.cpu.decoder import build_cpu_decoder

            self.cpu_decoder = build_cpu_decoder(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises if any parameter stays unloaded. A tensor of a linear
        layer (``<module>.<suffix>``: ``weight``, ``bias``, ``qweight``, ``scales``, ...) goes
        to that layer's method under its suffix and output shard; the rest copy as they are."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied: the embedding serves as the LM head
            if self.load_other_weight(name, tensor):
                continue  # a subclass's own layout (MoE experts)
            parts = name.split(".")
            packed = PACKED_MODULES.get(parts[-2]) if len(parts) >= 2 else None
            if packed is not None:
                module_name, shard = ".".join(parts[:-2] + [packed[0]]), packed[1]
            else:
                module_name, shard = ".".join(parts[:-1]), 0
            module = modules.get(module_name)
            if isinstance(module, MergedLinear):
                module.load(shard, parts[-1], tensor)
                loaded.add(f"{module_name}.{parts[-1]}#{shard}")
                continue
            if name not in params:
                raise KeyError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                )
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        if self.lm_head is not None and not any(k.startswith("lm_head.") for k in loaded):
            # some checkpoints omit a head equal to the embedding (and a quantized head of a
            # tied model is made from the embedding here)
            self.lm_head.load(0, "weight", self.embed_tokens.weight)
            loaded.update(
                f"lm_head.{n}#0" for n in self.lm_head.method.checkpoint_names(self.lm_head)
            )
        self._check_loaded(loaded)

    def load_other_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Hook for subclasses whose layers load tensors themselves; True when it took ``name``."""
        return False

    def _check_loaded(self, loaded: set[str]) -> None:
        missing = []
        linears = set()
        for name, module in self.named_modules():
            if not isinstance(module, MergedLinear):
                continue
            linears.add(name)
            kinds = module.method.checkpoint_names(module)
            for kind in (*kinds, "bias") if module.bias is not None else kinds:
                for shard in range(len(module.output_sizes)):
                    if f"{name}.{kind}#{shard}" not in loaded:
                        missing.append(f"{name}.{kind}[{shard}]")
        for name, _ in self.named_parameters():
            if name.rsplit(".", 1)[0] not in linears and name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (``attention_bias`` is set for this architecture)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k (``qk_norm`` is set for this architecture)."""
