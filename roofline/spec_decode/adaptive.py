"""The adaptive switch: the largest batch at which speculation still pays, from the roofline.

At batch ``b`` a plain decode step reads the weights once for ``b`` tokens; a speculative step
runs ``k`` draft steps (none for n-gram) and verifies ``b x (k + 1)`` tokens. While decode is
memory-bound the verification costs about one plain step and the step count falls by the
expected accepted length; once ``b x (k + 1)`` tokens make the step compute-bound the
verification costs up to ``k + 1`` plain steps and speculation loses. The threshold is the
largest batch whose roofline speedup (``planner/roofline.step_cost``, at an assumed acceptance
rate) stays above ``1 + margin``; ``disable_by_batch_size`` overrides it.
"""

from __future__ import annotations

import torch

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec, custom_gpu, get_gpu
from roofline.planner.roofline import Precision, step_cost
from roofline.planner.specdec import expected_tokens_per_step

ASSUMED_ACCEPTANCE = 0.6
"""Per-token acceptance assumed for n-gram and draft proposals when sizing the threshold."""
MARGIN = 0.1
"""Predicted speedup the threshold demands beyond break-even (host work, the sync step)."""
CPU_SPEC = custom_gpu("cpu", memory_gib=64, bandwidth_gb_per_s=40, bf16_tflops=0.5)
"""A rough dual-channel server-CPU stand-in for the roofline on CPU runs."""


def device_spec(device: torch.device) -> GPUSpec:
    if device.type != "cuda":
        return CPU_SPEC
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s", "4090"):
        if key in name:
            try:
                return get_gpu(key)
            except ValueError:
                break
    return get_gpu("h100")


def predicted_speedup(
    target: ModelConfig,
    draft: ModelConfig | None,
    hw: GPUSpec,
    alpha: float,
    k: int,
    batch_size: int,
    context_len: int = 1024,
    precision: Precision | None = None,
) -> float:
    """Roofline speedup of k proposals per request at ``batch_size`` (draft None: free)."""
    prec = precision or Precision()
    b, ctx = batch_size, context_len
    plain = step_cost(target, hw, b, b * ctx, precision=prec).time_s
    verify = step_cost(target, hw, prefill_chunks=[(k + 1, ctx - 1)] * b, precision=prec).time_s
    draft_s = 0.0 if draft is None else k * step_cost(draft, hw, b, b * ctx, precision=prec).time_s
    return expected_tokens_per_step(alpha, k) * plain / (verify + draft_s)


def batch_threshold(
    target: ModelConfig,
    draft: ModelConfig | None,
    device: torch.device,
    alpha: float,
    k: int,
    max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """Largest batch (0 if none) at which speculation is predicted to pay (see the module)."""
    hw = device_spec(device)
    name = {torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, "bf16")
    prec = Precision(weight_dtype=name, kv_dtype=name)
    best = 0
    b = 1
    while b <= max_num_seqs:
        if predicted_speedup(target, draft, hw, alpha, k, b, precision=prec) < 1.0 + MARGIN:
            break
        best = b
        b += 1 if b < 8 else b // 8
    return best
