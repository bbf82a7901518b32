"""The sparse MoE block: a router (``gate``, a plain linear layer E x H) and E SiLU-gated expert
MLPs whose weights are stacked, ``w13_weight [E, 2I, H]`` (each expert's gate rows, then its up
rows) and ``w2_weight [E, H, I]``, so one kernel launch serves every expert.

On CUDA the block runs ``kernels.fused_moe`` (routing kernel, then the decode GEMV or the sorted
grouped GEMM path: no host sync, CUDA-graph capturable). Elsewhere it runs the torch reference,
which loops over the experts that received a token, in HF transformers' order.

Checkpoint tensors arrive per expert (``load_expert(expert, proj, tensor)``, proj ``gate`` /
``up`` / ``down``) or already stacked over the experts (``expert=None``: GGUF's ``*_exps`` and
transformers 5's fused ``gate_up_proj``); ``missing()`` lists what no tensor has filled yet.
The expert weights are this layer's own parameters; quantized experts will plug in as a method
on this layer the way ``LinearMethod`` does on linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.layers.linear import Linear

_PROJ_SHARD = {"gate": 0, "up": 1}


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)  # router
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._warmed = False
        self._loaded: set[tuple[str, int]] = set()
        """(proj, expert) pairs a checkpoint tensor has filled; ("router", 0) for the gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        logits = self.gate(x)  # [num_tokens, num_experts]
        if x.is_cuda:
            from roofline.kernels.fused_moe import fused_moe, route, warm_up

            if not self._warmed:  # the first (eager) forward compiles every variant
                warm_up(x, self.w13_weight, self.w2_weight, self.top_k)
                self._warmed = True
            weights, ids = route(logits, self.top_k, self.renormalize)  # [num_tokens, top_k]
            return fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        from roofline.kernels.fused_moe import fused_moe_ref, route_ref

        weights, ids = route_ref(logits, self.top_k, self.renormalize)
        return fused_moe_ref(x, self.w13_weight, self.w2_weight, weights, ids)

    def load_router(self, tensor: torch.Tensor) -> None:
        self.gate.load(0, "weight", tensor)
        self._loaded.add(("router", 0))

    def load_expert(self, expert: int | None, proj: str, tensor: torch.Tensor) -> None:
        """One expert's ``gate``/``up`` [I, H] or ``down`` [H, I] weight, or (``expert`` None)
        all experts' stacked [E, ., .]; ``gate_up`` [E, 2I, H] is the stacked pair."""
        experts = range(self.num_experts) if expert is None else [expert]
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.num_experts})")
        inter = self.intermediate_size
        if proj == "down":
            target = self.w2_weight[expert] if expert is not None else self.w2_weight
        elif proj in _PROJ_SHARD:
            start = _PROJ_SHARD[proj] * inter
            rows = self.w13_weight[:, start : start + inter]
            target = rows[expert] if expert is not None else rows
        elif proj == "gate_up" and expert is None:
            target = self.w13_weight
        else:
            raise ValueError(f"unknown expert projection {proj!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {proj}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        for p in ("gate", "up") if proj == "gate_up" else (proj,):
            self._loaded.update((p, e) for e in experts)

    def missing(self) -> list[str]:
        """Names of the checkpoint tensors not loaded yet (empty when complete)."""
        out = [] if ("router", 0) in self._loaded else ["gate.weight"]
        for proj in ("gate", "up", "down"):
            out += [
                f"experts.{e}.{proj}"
                for e in range(self.num_experts)
                if (proj, e) not in self._loaded
            ]
        return out
