"""Prompt log-probabilities (vLLM's ``SamplingParams(prompt_logprobs=N)``), computed by the runner.

A step that computes positions ``[start, end)`` of a request's prompt has, at row ``p``, the
model's distribution of the token at ``p + 1``; for every ``p + 1`` still inside the prompt this
module takes the log-softmax of that row's logits and reports the prompt token's logprob and
rank and the top ``N``. Prompt token 0 has no distribution (``None`` in the output). Chunked
prefill just spreads a prompt's positions over several steps. A request that asks for prompt
logprobs never reads the prefix cache (``Scheduler``): the cached tokens' logits were never
computed, so it recomputes them, as vLLM does; after a preemption the recomputed positions
repeat ones already reported and the engine keeps the first. Only requests that ask pay
anything: the runner calls :func:`compute_prompt_logprobs` only while the engine has one.
Under tensor parallelism the engine sends each step's :class:`PromptLogprobRow` list (from
:func:`prompt_logprob_rows`) to every worker: all ranks take part in the LM head's gather, rank 0
replies with the result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from roofline.core.outputs import SchedulerOutput, TokenLogprobs

ROWS_PER_CHUNK = 256
"""LM-head rows per pass: bounds the fp32 logits to 256 x vocab at a time."""


class PromptLogprobRow(NamedTuple):
    """One request's prompt tokens predicted by a step: hidden rows ``[row0, row0 +
    len(targets))`` predict prompt positions ``first, first + 1, ...``."""

    request_id: str
    row0: int
    first: int
    targets: list[int]
    num_top: int


def prompt_logprob_rows(sched_out: SchedulerOutput) -> list[PromptLogprobRow]:
    """The step's rows that predict a prompt token, for requests that ask for prompt logprobs."""
    rows: list[PromptLogprobRow] = []
    row0 = 0
    for s in sched_out.scheduled:
        req, start, n = s.request, s.start_position, s.num_new_tokens
        num_top = req.sampling_params.prompt_logprobs
        end = min(start + n, req.num_prompt_tokens - 1)  # rows that predict a prompt token
        if num_top is not None and end > start:
            targets = req.prompt_token_ids[start + 1 : end + 1]
            rows.append(PromptLogprobRow(req.request_id, row0, start + 1, targets, num_top))
        row0 += n
    return rows


def compute_prompt_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,  # [num_tokens, hidden] the step's final hidden states, batch order
    rows: list[PromptLogprobRow],
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """request id -> (prompt index of the first entry, one entry per prompt token predicted in
    this step), for ``rows`` (see :func:`prompt_logprob_rows`)."""
    return {
        r.request_id: (
            r.first,
            _token_logprobs(model, hidden[r.row0 : r.row0 + len(r.targets)], r.targets, r.num_top),
        )
        for r in rows
    }


def _token_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, targets: list[int], num_top: int
) -> list[TokenLogprobs]:
    out: list[TokenLogprobs] = []
    for i in range(0, len(targets), ROWS_PER_CHUNK):
        logits = model.compute_logits(hidden[i : i + ROWS_PER_CHUNK])  # [R, V] fp32
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        ids = torch.tensor(targets[i : i + ROWS_PER_CHUNK], device=logits.device)[:, None]
        chosen = logprobs.gather(1, ids)  # [R, 1]
        rank = (logprobs > chosen).sum(dim=-1) + 1  # [R]
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [R, N]
        for tid, lp, rk, tv, ti in zip(
            ids[:, 0].tolist(),
            chosen[:, 0].tolist(),
            rank.tolist(),
            top_values.tolist(),
            top_ids.tolist(),
            strict=True,
        ):
            out.append(TokenLogprobs(tid, lp, rk, list(zip(ti, tv, strict=True))))
    return out
