"""Expert parallelism: a MoE layer's experts placed whole across the ranks of its group, and
how tokens reach the ranks that hold their experts and come back.

``enable_expert_parallel`` turns the tensor-parallel group into the MoE layers' expert-parallel
group (vLLM's ``--enable-expert-parallel``): attention, embeddings, the head and dense MLPs stay
tensor-parallel; rank ``r`` of ``n`` holds experts ``[r E/n, (r+1) E/n)`` whole
(:class:`ExpertPlacement`), and its loader reads only those experts' tensors. Without it, a MoE
model under tensor parallelism splits every expert's columns instead (each rank holds
``I / n`` of every expert, an all-reduce sums the partial outputs).

After attention's all-reduce every rank holds the hidden states of all ``T`` tokens and computes
the same routing (the router is replicated). Two ways to run the experts from there:

* :class:`ReplicatedDispatch` (the default): each rank runs its local experts on the pairs
  routed to them (ids of other ranks' experts become ``NOT_LOCAL``, which the fused kernel skips
  without reading a weight), giving a partial output; one all-reduce sums the partials. This is
  the all-gather + local selection + reduce-scatter scheme with the all-gather already done by
  attention and the reduce-scatter fused with the next layer's all-gather into one all-reduce:
  no host sync, static shapes, so it runs inside CUDA graphs, and it moves ``T H`` elements per
  layer, as the dense MLP's all-reduce does.
* :class:`AllToAllDispatch` (``ROOFLINE_EP_DISPATCH=all_to_all``): rank ``r`` takes its share
  of the tokens, sorts its ``(token, expert)`` pairs by owner rank, sends each owner its rows
  (``all_to_all_single`` with split sizes; the counts go first, one host read), the owner runs
  its experts on what it received (one pair per row), a second ``all_to_all_single`` returns the
  expert outputs in the sender's order, the sender weights and sums each token's ``k`` rows, and
  an all-gather restores every token on every rank for the next attention. The split sizes are
  read on the host, so a step captured in a CUDA graph takes the replicated path instead. With
  tensor-parallel attention it moves more than the replicated path (``k`` rows per token both
  ways plus the all-gather); it is the dispatch that data-parallel attention (tokens not
  replicated) would use, kept here tested and selectable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from roofline.config import ModelConfig
    from roofline.distributed.parallel_state import ParallelContext

EXPERT_PROJ = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_up_proj": "gate_up",
}
"""Checkpoint projection names (Qwen3-MoE, Mixtral, transformers 5 stacked) -> gate/up/down."""


@dataclass(frozen=True)
class ExpertTensor:
    """Where an expert checkpoint tensor belongs."""

    layer: int
    expert: int | None
    """The global expert id, or None for a tensor stacked over all experts ``[E, ., .]``."""
    proj: str
    """``gate``, ``up``, ``down`` or (stacked only) ``gate_up``."""


def parse_expert_tensor(name: str) -> ExpertTensor | None:
    """``model.layers.3.mlp.experts.7.gate_proj.weight`` (one expert),
    ``layers.3.mlp.experts.gate_up_proj`` (stacked) and Mixtral's ``block_sparse_moe.experts.7.w1
    .weight`` -> an :class:`ExpertTensor`; None for any other tensor (the router included)."""
    parts = name.removeprefix("model.").split(".")
    if len(parts) < 5 or parts[0] != "layers" or parts[3] != "experts" or not parts[1].isdigit():
        return None
    rest = parts[4:]
    if len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight":
        expert: int | None = int(rest[0])
        proj = rest[1]
    elif len(rest) in (1, 2) and (len(rest) == 1 or rest[1] == "weight"):
        expert, proj = None, rest[0]
    else:
        raise KeyError(f"checkpoint tensor {name!r}: unknown expert tensor layout")
    if proj not in EXPERT_PROJ:
        raise KeyError(f"checkpoint tensor {name!r}: unknown expert projection {proj!r}")
    return ExpertTensor(int(parts[1]), expert, EXPERT_PROJ[proj])


@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous ranges: rank ``ep_rank`` of ``ep_size`` owns experts
    ``[start, start + num_local)``."""

    num_experts: int
    ep_rank: int
    ep_size: int

    def __post_init__(self) -> None:
        check_expert_split(self.num_experts, self.ep_size)
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"expert-parallel rank {self.ep_rank} outside size {self.ep_size}")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def start(self) -> int:
        return self.ep_rank * self.num_local

    def owns(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.num_local

    def localize(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids ``[T, k]`` -> local ids, ``num_local`` (NOT_LOCAL) for other ranks'."""
        local = ids - self.start
        return torch.where((local >= 0) & (local < self.num_local), local, self.num_local)

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.div(ids, self.num_local, rounding_mode="floor")


def check_expert_split(num_experts: int, ep_size: int) -> None:
    if ep_size < 1:
        raise ValueError(f"expert-parallel size must be >= 1, got {ep_size}")
    if num_experts % ep_size:
        raise ValueError(
            f"enable_expert_parallel: {num_experts} experts do not split evenly over "
            f"{ep_size} ranks (tensor_parallel_size must divide the number of experts)"
        )


def check_moe_parallel(
    cfg: ModelConfig, world_size: int, expert_parallel: bool, group_size: int | None = None
) -> None:
    """Raise a ValueError when ``cfg``'s experts cannot go over ``world_size`` ranks
    (``group_size``: the experts' quantization group, which a rank's columns must keep whole)."""
    if not cfg.num_experts:
        if expert_parallel:
            raise ValueError(
                f"enable_expert_parallel needs a mixture-of-experts model; {cfg.architecture} "
                "has no experts"
            )
        return
    if world_size <= 1:
        return
    if expert_parallel:
        check_expert_split(cfg.num_experts, world_size)
    elif cfg.moe_intermediate_size % world_size:
        raise ValueError(
            f"moe_intermediate_size {cfg.moe_intermediate_size} does not split over "
            f"{world_size} ranks; pass enable_expert_parallel to place whole experts instead"
        )
    elif group_size and cfg.moe_intermediate_size // world_size % group_size:
        raise ValueError(
            f"each rank's {cfg.moe_intermediate_size // world_size} expert columns do not split "
            f"into quantization groups of {group_size}; pass enable_expert_parallel (whole "
            "experts per rank) or choose a smaller group"
        )


class ExpertRunner(Protocol):
    """The local experts of a layer: ``(x [R, H], weights [R, k], local ids [R, k]) -> [R, H]``
    (ids equal to the local expert count contribute nothing)."""

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor: ...


class ReplicatedDispatch:
    """Every rank holds every token: local experts on their pairs, then one all-reduce."""

    def __init__(self, placement: ExpertPlacement, parallel: ParallelContext) -> None:
        self.placement = placement
        self.parallel = parallel

    def __call__(
        self,
        experts: ExpertRunner,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        partial = experts(x, topk_weights, self.placement.localize(topk_ids))  # [T, H]
        return self.parallel.all_reduce(partial)


class AllToAllDispatch:
    """Each rank sends its share of the tokens' pairs to their experts' owners and back (see
    the module doc). Falls back to :class:`ReplicatedDispatch` inside a CUDA-graph capture."""

    def __init__(self, placement: ExpertPlacement, parallel: ParallelContext) -> None:
        self.placement = placement
        self.parallel = parallel
        self.replicated = ReplicatedDispatch(placement, parallel)

    def __call__(
        self,
        experts: ExpertRunner,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.replicated(experts, x, topk_weights, topk_ids)
        num_tokens, top_k = topk_ids.shape
        n, rank, group = self.parallel.world_size, self.parallel.rank, self.parallel.group
        share = -(-num_tokens // n)  # tokens per rank (the last ones may hold fewer)
        lo, hi = min(rank * share, num_tokens), min((rank + 1) * share, num_tokens)
        ids = topk_ids[lo:hi].reshape(-1)  # [P] this rank's pairs, global expert ids
        owner = self.placement.owner_of(ids)  # [P]
        order = torch.sort(owner, stable=True).indices  # [P] pairs grouped by owner rank
        send_counts = torch.bincount(owner, minlength=n)  # [n]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()  # the one host read
        rows = x[lo:hi][order // top_k]  # [P, H] the hidden row of each pair, by owner
        got_rows = x.new_empty(sum(recvs), x.shape[1])  # [R, H]
        dist.all_to_all_single(got_rows, rows.contiguous(), recvs, sends, group=group)
        got_ids = ids.new_empty(sum(recvs))  # [R]
        dist.all_to_all_single(got_ids, ids[order].contiguous(), recvs, sends, group=group)
        ones = torch.ones(got_ids.numel(), 1, dtype=x.dtype, device=x.device)
        local = self.placement.localize(got_ids[:, None])  # [R, 1], all local by construction
        done = experts(got_rows, ones, local)  # [R, H] each received pair's expert output
        back = x.new_empty(ids.numel(), x.shape[1])  # [P, H] in ``order``
        dist.all_to_all_single(back, done.contiguous(), sends, recvs, group=group)
        per_pair = torch.empty_like(back)
        per_pair[order] = back  # [P, H] in pair order
        weights = topk_weights[lo:hi].reshape(-1, 1)  # [P, 1]
        mine = (per_pair * weights).view(hi - lo, top_k, x.shape[1]).sum(1, dtype=torch.float32)
        padded = x.new_zeros(share, x.shape[1])  # [share, H]
        padded[: hi - lo] = mine.to(x.dtype)
        parts = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat(parts)[:num_tokens]  # [T, H] on every rank


DISPATCH_ENV = "ROOFLINE_EP_DISPATCH"
DISPATCHES = {"replicated": ReplicatedDispatch, "all_to_all": AllToAllDispatch}


def resolve_dispatch_name() -> str:
    """The dispatch ``ROOFLINE_EP_DISPATCH`` names in the engine's process (``replicated`` by
    default); the executor hands it to every worker in its spec."""
    name = os.environ.get(DISPATCH_ENV, "replicated")
    if name not in DISPATCHES:
        raise ValueError(f"{DISPATCH_ENV} must be one of {sorted(DISPATCHES)}, got {name!r}")
    return name


def make_dispatch(
    name: str, placement: ExpertPlacement, parallel: ParallelContext
) -> ReplicatedDispatch | AllToAllDispatch:
    if name not in DISPATCHES:
        raise ValueError(f"expert-parallel dispatch must be one of {sorted(DISPATCHES)}")
    return DISPATCHES[name](placement, parallel)
