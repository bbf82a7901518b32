"""Attention of fresh prompts (no cached prefix) through cuDNN's fused attention, where it beats
the Triton kernel.

A prefill step whose every request starts from position 0 needs plain causal attention over the
step's own rows, which torch's scaled-dot-product attention computes with cuDNN's Hopper kernels
straight from the strided q/k/v views of the QKV projection (grouped-query heads included). On
the H100, 8192-token prompt, 32/8 heads of 128: cuDNN 583 TFLOP/s against the descriptor (TMA)
kernel's 462 (``scripts/gpu_startup.py``). The backends send such a step to ``attend`` when the
switch is on, the dtype is 16-bit, the step is eager (not captured: the metadata's host lists
are there) and its requests are few and long enough for per-request launches to pay; otherwise
the caller runs the Triton kernel. ``ROOFLINE_FRESH_PREFILL=cudnn`` turns it on: off by default
until the whole-model gain and cuDNN's cost of a new prompt length (it builds an execution plan
per shape) are measured on the GPU (``scripts/gpu_startup.py``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

MIN_QUERY_LEN = 1024
"""Shortest fresh prompt sent to cuDNN (shorter ones: one Triton launch for the whole step)."""
MAX_REQUESTS = 4
"""Most requests in a step sent to cuDNN (one launch each)."""
_HALF = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """``ROOFLINE_FRESH_PREFILL`` is "cudnn"."""
    return os.environ.get("ROOFLINE_FRESH_PREFILL", "triton") == "cudnn"


def _backend():  # noqa: ANN202 - torch's SDPBackend member
    return torch.nn.attention.SDPBackend.CUDNN_ATTENTION


def applies(q: torch.Tensor, meta) -> bool:  # noqa: ANN001 - an AttentionMetadata
    """Whether this step's attention goes to ``attend`` (switch, dtype, device, requests)."""
    if not enabled() or q.dtype not in _HALF or not q.is_cuda:
        return False
    if not fresh_and_long(meta.seq_lens_cpu, meta.query_lens_cpu):
        return False
    return not torch.cuda.is_current_stream_capturing()


def fresh_and_long(seq_lens: list[int], query_lens: list[int]) -> bool:
    """1..MAX_REQUESTS requests, each a whole prompt of at least MIN_QUERY_LEN rows (empty
    host lists, as in captured graphs' metadata, never qualify)."""
    if not seq_lens or len(seq_lens) > MAX_REQUESTS:
        return False
    return all(s == n >= MIN_QUERY_LEN for s, n in zip(seq_lens, query_lens, strict=True))


def attend(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's rows, rotated
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    query_start: list[int],  # [num_reqs + 1] absolute rows of each request
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Causal attention of each request's rows over themselves, written into ``out``."""
    with torch.nn.attention.sdpa_kernel(_backend()):
        for a, b in zip(query_start, query_start[1:]):
            qh, kh, vh = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, n, D] views
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=kh.shape[1] != qh.shape[1])  # fmt: skip
            out[a:b].copy_(o[0].transpose(0, 1))  # [n, H, D]
    return out
