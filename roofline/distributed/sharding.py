"""How a model splits over tensor-parallel ranks, and which slice of each checkpoint tensor a
rank keeps.

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its rows of every packed
part: its query heads, its KV heads, its slice of the MLP columns), o_proj and down_proj are
row-parallel (each rank keeps the matching input columns; the partial outputs are summed by an
all-reduce), the embedding and the LM head are vocab-parallel (each rank keeps ``vocab / tp``
rows, padded up on the last rank). KV heads split evenly when there are at least as many as
ranks; with fewer (GQA 8 heads at TP 16), each KV head is replicated on the ``tp / kv`` ranks
whose query heads read it. Norms are replicated.

Quantized checkpoints: a tensor is sliced by its role and shape, which covers the canonical
layouts of ``roofline.quantization`` (int8 ``qweight [N, K]``, int4 ``qweight [N, K // 2]``,
``scales``/``offsets [N, K // group]``, fp8 ``scales [N]`` or ``[1]``): column-parallel tensors
lose rows, row-parallel ones lose a ``1 / tp`` share of their last dimension, which keeps whole
groups on one rank exactly when ``K // group`` splits evenly (else a clear error); a per-channel
scale (one column) or a per-tensor scale is replicated. A method whose checkpoint layout is not
canonical (GPTQ's ``[K // 8, N]`` int32) slices its own tensors through the ``shard_slice`` hook
of its ``LinearMethod`` (``shard_slice(name, tensor, axis, start, size)``, the slice given in
unquantized weight elements by :func:`weight_slice`): the loader calls it instead whenever the
layer's method overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roofline.config import ModelConfig
from roofline.distributed.expert_parallel import (
    ExpertTensor,
    check_moe_parallel,
    parse_expert_tensor,
)

Kind = Literal["column", "row", "vocab", "replicated"]

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class TensorSlice:
    """``tensor.narrow(dim, start, length)``; rows past the tensor (vocab padding) are zeros:
    the result has ``padded_length`` entries along ``dim``."""

    dim: int
    start: int
    length: int
    padded_length: int


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a model: local head counts and where its slices start."""

    rank: int
    world_size: int
    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (1 when KV heads are replicated)."""
    kv_head_start: int
    """Global index of this rank's first KV head."""
    intermediate_size: int
    vocab_per_rank: int
    """Embedding / LM-head rows per rank (``ceil(vocab / tp)``)."""
    expert_parallel: bool = False
    """MoE experts placed whole over the ranks (else each expert's columns split)."""
    num_experts: int = 0
    moe_intermediate_size: int = 0
    """Columns of each local expert (``I / tp`` unless expert-parallel)."""

    @classmethod
    def of(
        cls, cfg: ModelConfig, rank: int, world_size: int, expert_parallel: bool = False
    ) -> ShardLayout:
        check_shardable(cfg, world_size, expert_parallel)
        kv = cfg.num_key_value_heads
        local_kv = max(kv // world_size, 1)
        kv_start = rank * local_kv if kv >= world_size else rank * kv // world_size
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=cfg.num_attention_heads // world_size,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate_size=cfg.intermediate_size // world_size,
            vocab_per_rank=-(-cfg.vocab_size // world_size),
            expert_parallel=expert_parallel and world_size > 1,
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size
            // (1 if expert_parallel else world_size),
        )

    def keeps(self, name: str) -> bool:
        """Whether this rank loads tensor ``name`` at all (False: another rank's expert)."""
        if not self.expert_parallel:
            return True
        where = parse_expert_tensor(name)
        if where is None or where.expert is None:
            return True
        per = self.num_experts // self.world_size
        return self.rank * per <= where.expert < (self.rank + 1) * per

    def kind(self, name: str) -> Kind:
        """The role of an HF-named checkpoint tensor (``model.layers.0.mlp.up_proj.weight``)."""
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in COLUMN:
            return "column"
        if module in ROW:
            return "row"
        if module in VOCAB:
            return "vocab"
        return "replicated"

    def slice_of(self, name: str, shape: tuple[int, ...], head_dim: int) -> TensorSlice | None:
        """This rank's slice of the tensor ``name`` of ``shape`` (None: it keeps all of it)."""
        if self.world_size == 1:
            return None
        where = parse_expert_tensor(name) if self.num_experts else None
        if where is not None:
            return self._expert_slice(name, where, shape)
        kind = self.kind(name)
        if kind == "replicated":
            return None
        module = name.split(".")[-2]
        if kind == "vocab":
            per = self.vocab_per_rank
            start = min(self.rank * per, shape[0])
            return TensorSlice(0, start, min(per, shape[0] - start), per)
        if kind == "column":
            if len(shape) == 1 and shape[0] == 1:
                return None  # a per-tensor scale
            if module == "q_proj":
                rows = self.num_heads * head_dim
                start = self.rank * rows
            elif module in ("k_proj", "v_proj"):
                rows = self.num_kv_heads * head_dim
                start = self.kv_head_start * head_dim
            else:
                rows = self.intermediate_size
                start = self.rank * rows
            if shape[0] != rows * self.world_size and module not in ("k_proj", "v_proj"):
                raise ValueError(f"{name}: {shape[0]} rows do not split into {rows} per rank")
            return TensorSlice(0, start, rows, rows)
        # row-parallel: the last dimension is K (or K // 2, K // group)
        if len(shape) == 1 or shape[-1] == 1:
            return None  # per-channel or per-tensor scale (row-parallel layers carry no bias)
        cols = shape[-1]
        if cols % self.world_size:
            raise ValueError(
                f"{name}: {cols} columns (K, K // 2 or K // group) do not split over "
                f"{self.world_size} ranks; a quantization group would straddle two ranks"
            )
        per = cols // self.world_size
        return TensorSlice(len(shape) - 1, self.rank * per, per, per)

    def _expert_slice(
        self, name: str, where: ExpertTensor, shape: tuple[int, ...]
    ) -> TensorSlice | None:
        """Expert parallelism: one expert whole, a stack ``[E, ., .]`` cut to this rank's
        experts. Tensor-parallel experts: ``I / tp`` rows of gate/up, columns of down."""
        if self.expert_parallel:
            if where.expert is not None:
                return None
            per = self.num_experts // self.world_size
            return TensorSlice(0, self.rank * per, per, per)
        inter = self.moe_intermediate_size
        stacked = 1 if where.expert is None else 0
        if where.proj == "gate_up":
            raise ValueError(
                f"{name}: a fused gate_up expert stack cannot be split by columns; pass "
                "enable_expert_parallel to place whole experts instead"
            )
        dim = stacked if where.proj in ("gate", "up") else len(shape) - 1
        if shape[dim] != inter * self.world_size:
            raise ValueError(f"{name}: {shape[dim]} columns do not split into {inter} per rank")
        return TensorSlice(dim, self.rank * inter, inter, inter)


def weight_slice(
    layout: ShardLayout, name: str, cfg: ModelConfig
) -> tuple[Literal["out", "in"], int, int] | None:
    """This rank's part of the *unquantized* weight of the linear layer ``name`` belongs to, as
    ``(axis, start, size)`` in weight elements (what ``LinearMethod.shard_slice`` takes)."""
    kind = layout.kind(name)
    if kind in ("replicated", "vocab") or layout.world_size == 1:
        return None
    module, d = name.split(".")[-2], cfg.head_dim
    if module == "q_proj":
        return "out", layout.rank * layout.num_heads * d, layout.num_heads * d
    if module in ("k_proj", "v_proj"):
        return "out", layout.kv_head_start * d, layout.num_kv_heads * d
    if module in ("gate_proj", "up_proj"):
        return "out", layout.rank * layout.intermediate_size, layout.intermediate_size
    k = layout.num_heads * d if module == "o_proj" else layout.intermediate_size
    return "in", layout.rank * k, k


def check_shardable(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raise a ValueError when ``cfg`` cannot split over ``world_size`` ranks (its experts
    placed whole when ``expert_parallel``)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    check_moe_parallel(cfg, world_size, expert_parallel)
    if world_size == 1:
        return
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"{heads} attention heads do not split over {world_size} ranks")
    if kv % world_size and world_size % kv:
        raise ValueError(
            f"{kv} KV heads neither split over {world_size} ranks nor divide them "
            "(needed to replicate each KV head on a whole number of ranks)"
        )
    if cfg.intermediate_size % world_size:
        raise ValueError(
            f"intermediate_size {cfg.intermediate_size} does not split over {world_size} ranks"
        )
