"""Verification on the device: a step's accept/reject decisions with no host sync but the last.

``Verifier`` (``verifier.py``) is the general path: it reads the accept decisions on the host
between device operations, which is right for seeded requests (their draws come from per-request
generators in order), logprobs and proposers with full draft distributions. Every other step
(the common case) goes through :func:`launch_verification`: the ``1 + k_i`` rows of every
request are gathered into a padded ``[R, K + 1]`` grid (``K`` the step's largest k; a request
without proposals is a ``k = 0`` row, so plain requests of the same step ride along), and

* greedy rows accept the longest prefix where the proposal equals the target's argmax
  (``greedy_argmax``, the sampler's own), the emitted tokens being the argmaxes themselves;
* sampled rows (one-hot proposals: n-gram, greedy drafts, the oracle) accept ``d_j`` iff
  ``u_j < p_j(d_j)``, then draw the last token by the exponential race from ``p`` at the first
  rejection with ``d`` removed (``norm(max(0, p - q))`` for one-hot ``q``), or from ``p`` after
  ``k`` accepts — Leviathan et al.'s rule, the same as ``Verifier``'s;

all as batched tensor operations. The step's result, ``[R, K + 2]`` (the emitted tokens then the
accepted count), goes to pinned host memory behind the step with one event, read once by
:class:`DeviceVerifyHandle.result`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from roofline.core.outputs import ModelRunnerOutput, VerifiedTokens
from roofline.layers.sampler import SAMPLING_EPS, SamplingTensors, _plain_greedy, greedy_argmax
from roofline.request import Request
from roofline.spec_decode.verifier import _RowView
from roofline.worker.host_batch import upload


def on_device_ok(requests: list[Request]) -> bool:
    """Whether :func:`launch_verification` can take the step (no seeds, no logprobs)."""
    for r in requests:
        p = r.sampling_params
        if p.seed is not None or p.logprobs is not None:
            return False
    return True


class DeviceVerifyHandle:
    """A verification step's tokens on their way to the host (``StepHandle``'s contract)."""

    def __init__(self, requests: list[Request], result: Tensor) -> None:
        self._requests = requests
        self._event: torch.cuda.Event | None = None
        self._host = result
        if result.is_cuda:
            self._host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            self._host.copy_(result, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()  # the step's one host sync
        rows = self._host.tolist()
        out = ModelRunnerOutput(sampled_token_ids={})
        for r, row in zip(self._requests, rows):
            k = len(r.spec_token_ids)
            num_accepted = row[-1]
            ids = row[: num_accepted + 1]
            out.sampled_token_ids[r.request_id] = ids[-1]
            if k:
                out.verified[r.request_id] = VerifiedTokens(ids, k)
        return out


def launch_verification(logits: Tensor, requests: list[Request]) -> DeviceVerifyHandle:
    """``logits`` ([sum(1 + k_i), V], fp32): ``1 + k_i`` rows per request in order, ``k_i =
    len(requests[i].spec_token_ids)`` (0 for a plain request)."""
    device = logits.device
    ks = [len(r.spec_token_ids) for r in requests]
    max_k = max(ks)
    width = max_k + 1
    k_np = np.asarray(ks, dtype=np.int64)  # [R]
    ends = np.cumsum(k_np + 1)  # [R] one past each request's last row
    if int(ends[-1]) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {int(ends[-1])} verification rows")
    # [R * width] row of each grid cell (a request's last row repeated)
    cells = np.minimum(np.arange(width)[None, :], k_np[:, None])  # [R, W]
    index = ((ends - k_np - 1)[:, None] + cells).ravel().tolist()
    proposals: list[int] = []  # [R * max_k] (0 past k_i: never accepted, masked)
    for r, k in zip(requests, ks):
        proposals += r.spec_token_ids
        if k < max_k:
            proposals += [0] * (max_k - k)
    index_t, prop_t, k_t = upload([index, proposals, ks], device)
    index_t = index_t.view(len(requests), width)  # [R, W]
    prop_t = prop_t.view(len(requests), max_k)  # [R, K]
    cols = torch.arange(max_k, device=device)  # [K]
    in_range = cols[None, :] < k_t[:, None]  # [R, K]
    greedy = [r.sampling_params.temperature < SAMPLING_EPS for r in requests]
    if all(_plain_greedy(r) for r in requests):
        target = greedy_argmax(logits)[index_t]  # [R, W]
        match = (target[:, :max_k] == prop_t) & in_range  # [R, K]
        num_accepted = match.int().cumprod(dim=1).sum(dim=1)  # [R]
        result = torch.cat([target, num_accepted[:, None].long()], dim=1)  # [R, W + 1]
        return DeviceVerifyHandle(requests, result)
    views: list[_RowView] = []
    for r in requests:
        spec, num_output = r.spec_token_ids, r.num_output_tokens
        views.extend(_RowView(r, spec[:j], num_output) for j in range(len(spec) + 1))
    t = SamplingTensors.from_requests(views, logits.shape[1], device)  # type: ignore[arg-type]
    processed = apply(logits, t)  # [N, V]
    target = processed.argmax(dim=-1)[index_t]  # [R, W]
    greedy_t = torch.tensor(greedy, device=device)  # [R]
    probs = processed.softmax(dim=-1)  # [N, V]
    p_d = probs[index_t[:, :max_k].reshape(-1), prop_t.reshape(-1)].view_as(prop_t)  # [R, K]
    u = torch.rand(p_d.shape, device=device)  # [R, K]
    accept = torch.where(greedy_t[:, None], target[:, :max_k] == prop_t, u < p_d) & in_range
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1).long()  # [R]
    last_row = index_t.gather(1, num_accepted[:, None]).squeeze(1)  # [R]
    dist = probs[last_row]  # [R, V] p at the first rejection (or after all k)
    rejected = num_accepted < k_t  # [R]
    d = prop_t.gather(1, num_accepted.clamp(max=max(max_k - 1, 0))[:, None])  # [R, 1]
    residual = dist.scatter(1, d, 0.0)  # [R, V] p without the rejected proposal
    use_residual = rejected & (residual.sum(dim=1) > 0)  # p == q: rejection had probability 0
    dist = torch.where(use_residual[:, None], residual, dist)
    race = torch.empty_like(dist).exponential_().clamp_(min=torch.finfo(dist.dtype).tiny)
    drawn = (dist / race).argmax(dim=-1)  # [R]
    last = torch.where(greedy_t, target.gather(1, num_accepted[:, None]).squeeze(1), drawn)
    cols_w = torch.arange(width, device=device)  # [W]
    emitted = torch.where(
        cols_w[None, :] < num_accepted[:, None], torch.cat([prop_t, prop_t[:, :1]], dim=1), 0
    )  # [R, W] the accepted proposals
    emitted = emitted.scatter(1, num_accepted[:, None], last[:, None])  # then the last token
    return DeviceVerifyHandle(requests, torch.cat([emitted, num_accepted[:, None]], dim=1))


def apply(logits: Tensor, t: SamplingTensors) -> Tensor:
    """The processed logits the sampler would see ([N, V] fp32)."""
    from roofline.layers.sampler import Sampler

    return Sampler._process(logits.float(), t) if t.needs_processing else logits.float()
