"""The sparse MoE block: a router (``gate``, a plain linear layer E x H, replicated under every
kind of parallelism) and SiLU-gated expert MLPs whose weights are stacked, ``w13_weight
[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``w2_weight [E, H, I]``, so one
kernel launch serves every expert.

The expert weights belong to a ``quantization.moe.MoEMethod`` (16-bit, or int8 / fp8 with
per-channel scales): it creates them, quantizes checkpoint tensors as they load and runs the
kernel (``kernels.fused_moe`` on CUDA: routing kernel, then the decode GEMV or the sorted grouped
GEMM path, no host sync, CUDA-graph capturable; elsewhere the torch reference, which loops over
the experts that received a token, in HF transformers' order).

Under a parallel context the layer holds either whole experts of its rank (expert parallelism:
``E / n`` local experts, a ``distributed.expert_parallel`` dispatch) or ``I / n`` columns of
every expert (tensor parallelism: the partial outputs all-reduced).

Checkpoint tensors arrive per expert (``load_expert(expert, proj, tensor)``, ``expert`` the
global id, proj ``gate`` / ``up`` / ``down``; another rank's expert is ignored) or stacked over
this rank's experts (``expert=None``: GGUF's ``*_exps`` and transformers 5's fused
``gate_up_proj``); ``missing()`` lists what no tensor has filled yet.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.distributed.expert_parallel import ExpertPlacement, make_dispatch
from roofline.distributed.parallel_state import SINGLE, ParallelContext
from roofline.layers.linear import Linear
from roofline.quantization.moe import MoEMethod, UnquantizedMoEMethod

_PROJ_SHARD = {"gate": 0, "up": 1}
DUMMY_EXPERTS_PER_DRAW = 8
"""Random (dummy) experts are drawn and loaded this many at a time."""


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        method: MoEMethod | None = None,
        parallel: ParallelContext = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.method = method or UnquantizedMoEMethod()
        self.placement: ExpertPlacement | None = None
        """This rank's experts under expert parallelism (None: every expert is here)."""
        self.dispatch = None
        self.reduce = None
        if parallel.is_parallel and expert_parallel:
            self.placement = ExpertPlacement(num_experts, parallel.rank, parallel.world_size)
            self.dispatch = make_dispatch(
                parallel.expert_parallel_dispatch, self.placement, parallel
            )
        elif parallel.is_parallel:  # tensor-parallel experts: I / n columns of each
            if intermediate_size % parallel.world_size:
                raise ValueError(
                    f"moe_intermediate_size {intermediate_size} does not split over "
                    f"{parallel.world_size} ranks"
                )
            intermediate_size //= parallel.world_size
            self.reduce = parallel.all_reduce
        self.intermediate_size = intermediate_size
        """Columns of each local expert (``I / n`` under tensor parallelism)."""
        self.num_local_experts = self.placement.num_local if self.placement else num_experts
        self.expert_start = self.placement.start if self.placement else 0
        self.gate = Linear(hidden_size, num_experts)  # router
        self.method.create_weights(
            self, self.num_local_experts, intermediate_size, hidden_size, torch.get_default_dtype()
        )
        self._warmed = False
        self._loaded: set[tuple[str, int]] = set()
        """(proj, global expert) pairs a checkpoint tensor has filled; ("router", 0) for the
        gate."""

    def forward(
        self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        if norm is not None and residual is not None:  # one token, x the whole residual stream:
            from roofline.layers.fused_decode import moe_norm_add  # x + self(norm(x)), fused

            return moe_norm_add(self, norm, x)
        logits = self.gate(x)  # [num_tokens, num_experts]
        if x.is_cuda:
            from roofline.kernels.fused_moe import route, warm_up

            if not self._warmed:  # the first (eager) forward compiles every variant
                warm_up(x, self.w13_weight, self.w2_weight, self.top_k, self.quant_tensors())
                self._warmed = True
            weights, ids = route(logits, self.top_k, self.renormalize)  # [num_tokens, top_k]
        else:
            from roofline.kernels.fused_moe import route_ref

            weights, ids = route_ref(logits, self.top_k, self.renormalize)
        if self.dispatch is not None:
            return self.dispatch(self.run_local_experts, x, weights, ids)
        out = self.method.apply(self, x, weights, ids)
        return out if self.reduce is None else self.reduce(out)

    def run_local_experts(
        self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on ``x [R, H]``; ids index the local experts (their count:
        another rank's)."""
        return self.method.apply(self, x, topk_weights, local_ids)

    def quant_tensors(self) -> dict[str, torch.Tensor]:
        """The experts' scales and offsets by ``fused_moe``'s argument names (empty: 16-bit)."""
        names = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}

    def load_router(self, tensor: torch.Tensor) -> None:
        self.gate.load(0, "weight", tensor)
        self._loaded.add(("router", 0))

    def load_expert(self, expert: int | None, proj: str, tensor: torch.Tensor) -> None:
        """One expert's ``gate``/``up`` [I, H] or ``down`` [H, I] weight (``expert``: its global
        id; another rank's expert is ignored), or (``expert`` None) this rank's experts stacked
        [E_local, ., .]; ``gate_up`` [E_local, 2I, H] is the stacked pair."""
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.num_experts})")
        if expert is not None and self.placement is not None and not self.placement.owns(expert):
            return  # another rank's expert (a loader that cannot skip it, e.g. GGUF)
        start = self.expert_start
        if expert is None:
            experts, ids = slice(None), range(start, start + self.num_local_experts)
        else:
            experts, ids = slice(expert - start, expert - start + 1), range(expert, expert + 1)
        inter = self.intermediate_size
        if proj == "down":
            which, rows = "w2", slice(None)
        elif proj in _PROJ_SHARD:
            first = _PROJ_SHARD[proj] * inter
            which, rows = "w13", slice(first, first + inter)
        elif proj == "gate_up" and expert is None:
            which, rows = "w13", slice(None)
        else:
            raise ValueError(f"unknown expert projection {proj!r}")
        self.method.load(self, which, experts, rows, tensor)
        for p in ("gate", "up") if proj == "gate_up" else (proj,):
            self._loaded.update((p, e) for e in ids)

    def missing(self) -> list[str]:
        """Names of the checkpoint tensors not loaded yet (empty when complete)."""
        out = [] if ("router", 0) in self._loaded else ["gate.weight"]
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        for proj in ("gate", "up", "down"):
            out += [f"experts.{e}.{proj}" for e in local if (proj, e) not in self._loaded]
        return out

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    @torch.no_grad()
    def init_dummy_weights(
        self, gen: torch.Generator, std: float, dtype: torch.dtype | None = None
    ) -> None:
        """Random N(0, std) experts drawn in ``dtype`` (the checkpoint's) and loaded through the
        method, a few experts at a time (a quantized method quantizes them as it would a
        checkpoint); the router's weight is the caller's."""
        device = self.w13_weight.device
        dtype = dtype or torch.float32
        inter, hidden = self.intermediate_size, self.hidden_size
        for first in range(0, self.num_local_experts, DUMMY_EXPERTS_PER_DRAW):
            count = min(DUMMY_EXPERTS_PER_DRAW, self.num_local_experts - first)
            experts = slice(first, first + count)
            shapes = (("w13", (count, 2 * inter, hidden)), ("w2", (count, hidden, inter)))
            for which, shape in shapes:
                w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
                self.method.load(self, which, experts, slice(None), w)
        start = self.expert_start
        for proj in ("gate", "up", "down"):
            self._loaded.update((proj, e) for e in range(start, start + self.num_local_experts))
