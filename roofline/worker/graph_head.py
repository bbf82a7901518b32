"""The LM head and greedy sampling inside the small decode CUDA graphs.

At batch 1 a small model's step ends with the LM head, a float copy of its logits and three
reduction kernels for the argmax, each launched from Python after the graph. For buckets of at
most ``MAX_ROWS`` rows the decode graphs also capture ``kernels.lm_head_argmax`` on their hidden
states: one kernel that writes the fp32 logits (the bits ``model.compute_logits`` gives) and the
greedy ids. A step whose rows are all plain greedy without logprobs (and whose logits nothing
edits) takes the ids as they are: a step is one graph replay and the copy of its ids; any other
step samples from the graph's logits as it would from ``compute_logits``.

It applies where ``compute_logits`` is a 16-bit skinny GEMM on one device: an unquantized head
(or the tied embedding) with a tuned config for the bucket's rows, no tensor parallelism, and
``LlamaForCausalLM.compute_logits`` itself. The largest bucket (a saturated batch: 256 rows by
default) captures the model's own head instead (``full_head``: ``compute_logits(upcast=False)``
and the argmax), so that its greedy steps skip the LM head and the sampler on the host too.
``ROOFLINE_GRAPH_HEAD=0`` (or ``set_enabled(False)`` before the graphs are captured) turns both
off.
"""

from __future__ import annotations

import os
from operator import attrgetter
from typing import NamedTuple

import torch

from roofline.request import Request

MAX_ROWS = 8  # the skinny GEMM's largest row bucket
_ENABLED = os.environ.get("ROOFLINE_GRAPH_HEAD", "1") != "0"


class HeadOutputs(NamedTuple):
    logits: torch.Tensor  # [rows, vocab]: fp32 as model.compute_logits (the small buckets), or
    # the head's own dtype as compute_logits(upcast=False) (the largest bucket: full_head)
    token_ids: torch.Tensor  # [rows] int64: each row's argmax (first index of the max)


def set_enabled(enabled: bool) -> None:
    """Capture the head in the decode graphs or not (graphs captured from now on)."""
    global _ENABLED
    _ENABLED = enabled


def head_weight(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The ``[vocab, hidden]`` weight ``model.compute_logits(hidden)`` multiplies by on the
    skinny GEMM, or None where it computes logits any other way."""
    from roofline.layers.linear import MergedLinear, skinny_gemm_applies
    from roofline.models.llama import LlamaForCausalLM
    from roofline.quantization.base import UnquantizedLinearMethod

    if not isinstance(model, LlamaForCausalLM) or model.parallel.is_parallel:
        return None
    if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return None
    head = model.lm_head
    if head is None:
        weight = model.embed_tokens.weight  # tied
    elif (
        type(head).forward is MergedLinear.forward
        and type(head.method) is UnquantizedLinearMethod
        and head.bias is None
    ):
        weight = head.weight
    else:
        return None
    return weight if skinny_gemm_applies(hidden, weight) else None


def capture_head(model: torch.nn.Module, hidden: torch.Tensor) -> HeadOutputs | None:
    """Logits and greedy ids of ``hidden: [rows, hidden]`` in one launch (inside a graph being
    captured, or eagerly to warm it up), or None where the head does not apply."""
    if not _ENABLED or not hidden.is_cuda or hidden.shape[0] > MAX_ROWS:
        return None
    weight = head_weight(model, hidden)
    if weight is None:
        return None
    from roofline.kernels.lm_head_argmax import lm_head_argmax

    return HeadOutputs(*lm_head_argmax(hidden, weight))


def full_head(model: torch.nn.Module, hidden: torch.Tensor) -> HeadOutputs | None:
    """The head of the largest decode bucket, captured in its graph: the logits exactly as
    ``model.compute_logits(hidden, upcast=False)`` computes them after the graph (the head's
    dtype; the sampler casts what needs fp32) and their greedy ids, so that a saturated decode
    step (every row greedy) launches no LM head, argmax or sampler work from Python: ~0.3 ms of
    host time per step at 256 rows of the 8B on the H100's host. The logits stay in the graph's
    pool (~66 MB at 256 x 128k in bf16: one bucket only). None where the head is not a plain
    16/32-bit linear on one device (as ``head_weight``, any row count) or it is turned off."""
    if not _ENABLED or not hidden.is_cuda or not _plain_head(model):
        return None
    from roofline.layers.sampler import greedy_argmax

    logits = model.compute_logits(hidden, upcast=False)  # [rows, vocab]
    return HeadOutputs(logits, greedy_argmax(logits))


def _plain_head(model: torch.nn.Module) -> bool:
    from roofline.layers.linear import MergedLinear
    from roofline.models.llama import LlamaForCausalLM
    from roofline.quantization.base import UnquantizedLinearMethod

    if not isinstance(model, LlamaForCausalLM) or model.parallel.is_parallel:
        return False
    if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return False
    head = model.lm_head
    return head is None or (
        type(head).forward is MergedLinear.forward
        and type(head.method) is UnquantizedLinearMethod
        and head.bias is None
    )


_ARGMAX_ONLY = attrgetter("argmax_only")


def greedy_ids_suffice(requests: list[Request]) -> bool:
    """Whether every row's token is the raw logits' argmax and nothing else is asked of them
    (the sampler's plain-greedy rows, no logprobs): one C-level pass over ``argmax_only`` for
    the common step, the full rule otherwise (a ``min_tokens`` already reached)."""
    if all(map(_ARGMAX_ONLY, requests)):
        return True
    from roofline.layers.sampler import _plain_greedy

    return all(_plain_greedy(r) and r.sampling_params.logprobs is None for r in requests)
