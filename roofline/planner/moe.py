"""Mixture-of-experts arithmetic for the roofline: how many experts a step's tokens touch.

A token routed to ``k`` of ``E`` experts leaves a given expert unused with probability
``1 - k / E``; with routing independent and uniform across ``B`` tokens, an expert is touched with
probability ``1 - (1 - k / E) ** B``, so a step reads ``E * (1 - (1 - k / E) ** B)`` experts'
weights per MoE layer in expectation: ``k`` at batch 1, nearly all ``E`` at large batches
(Qwen3-30B-A3B, 128 experts top-8: 8 at B = 1, 51.6 at B = 8, 111.8 at B = 32, 128.0 at B = 128).
Real routers are not uniform (some experts are hot), which touches fewer experts than this: the
roofline is then slightly pessimistic, never flattering.
"""

from __future__ import annotations

from roofline.config import ModelConfig


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts of one layer that ``num_tokens`` tokens route to."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if num_tokens < 0:
        raise ValueError("num_tokens must be non-negative")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def experts_read(model: ModelConfig, num_tokens: int | None) -> float | None:
    """Experts per MoE layer whose weights a step of ``num_tokens`` reads (None for a dense
    model; all of them when ``num_tokens`` is None, as for memory sizing)."""
    if not model.num_experts:
        return None
    if num_tokens is None:
        return float(model.num_experts)
    return expected_experts_touched(model.num_experts, model.num_experts_per_tok, num_tokens)
