"""The model runner's side of a verification step: split the sampled logits rows between the
plain sampler (requests without proposals) and the verifier (``1 + k`` rows per speculating
request), and hand back the step's tokens. Steps with proposals run synchronously (their
emitted counts decide the next step's inputs), so the result is ready at once."""

from __future__ import annotations

import torch
from torch import Tensor

from roofline.core.outputs import ModelRunnerOutput, VerifiedTokens
from roofline.layers.sampler import Sampler
from roofline.request import Request
from roofline.spec_decode.verifier import Verifier


class VerifiedHandle:
    """A finished step's output, shaped like ``StepHandle`` (``result()``)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


def verify_step(
    sampler: Sampler, verifier: Verifier, logits: Tensor, requests: list[Request]
) -> VerifiedHandle:
    """``logits`` ([num_rows, V]): one row per plain request, ``1 + k`` per speculating one,
    in the order of ``requests``."""
    plain_rows: list[int] = []
    plain: list[Request] = []
    spec_rows: list[int] = []
    spec: list[Request] = []
    row = 0
    for r in requests:
        n = len(r.spec_token_ids) + 1
        if n == 1:
            plain_rows.append(row)
            plain.append(r)
        else:
            spec_rows.extend(range(row, row + n))
            spec.append(r)
        row += n
    out = ModelRunnerOutput(sampled_token_ids={})
    device = logits.device
    if plain:
        rows = torch.tensor(plain_rows, device=device)  # [num_plain]
        sampled = sampler.sample(logits.index_select(0, rows), plain)
        for r, token, lp in zip(plain, sampled.token_ids.tolist(), sampled.logprobs):
            out.sampled_token_ids[r.request_id] = token
            if lp is not None:
                out.logprobs[r.request_id] = lp
    rows = torch.tensor(spec_rows, device=device)  # [num_spec_rows]
    verified: list[VerifiedTokens] = verifier.verify(logits.index_select(0, rows), spec)
    for r, v in zip(spec, verified):
        out.sampled_token_ids[r.request_id] = v.token_ids[-1]
        out.verified[r.request_id] = v
    return VerifiedHandle(out)
