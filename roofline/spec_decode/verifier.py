"""The verifier: which proposed tokens the target accepts, and the one token it adds.

A request scheduled with proposals ``d_1 .. d_k`` gets ``k + 1`` logits rows: row ``j`` is the
target's distribution for the token after ``d_1 .. d_j`` (row 0: after the known tokens). Each
row is processed exactly as the plain sampler would process it at that point of the output
(penalties and ``min_tokens`` see ``d_1 .. d_j`` as output, then temperature, top-k, top-p,
min-p), giving ``p_j``. Then, in order:

* **accepted tokens**: greedy rows accept ``d_{j+1}`` while it equals ``argmax p_j``; sampled
  rows accept it with probability ``min(1, p_j(d) / q_j(d))``, ``q_j`` being the proposer's
  distribution (one-hot for n-gram, greedy drafts and the oracle, so the test is ``u < p_j(d)``);
* **recovered token**: at the first rejection ``j``, greedy emits ``argmax p_j``; sampled rows
  draw from ``norm(max(0, p_j - q_j))`` (for one-hot ``q``: ``p_j`` without ``d``);
* **bonus token**: when all ``k`` are accepted, one more token from ``p_k``.

This is Leviathan et al.'s rejection sampling: every emitted token is distributed exactly as
plain sampling would draw it. A seeded request draws its uniforms and its last token from its
own generator (the sampler's), so it reproduces run to run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roofline.core.outputs import VerifiedTokens
from roofline.layers.sampler import SAMPLING_EPS, Sampler, SamplingTensors
from roofline.request import Request


class _RowView:
    """A request as the sampler sees it at one verification row: the proposals before the
    row count as output (penalties, min_tokens)."""

    __slots__ = (
        "request",
        "extra",
        "request_id",
        "sampling_params",
        "eos_token_ids",
        "num_output_tokens",
    )

    def __init__(self, request: Request, extra: list[int], num_output_tokens: int) -> None:
        self.request = request
        self.extra = extra
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.num_output_tokens = num_output_tokens + len(extra)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra


class Verifier:
    """Verifies the rows of speculating requests; shares the sampler's seeded generators."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(
        self,
        logits: Tensor,
        requests: list[Request],
        draft_probs: list[Tensor | None] | None = None,
    ) -> list[VerifiedTokens]:
        """``logits`` ([sum(k_i + 1), V]) holds ``k_i + 1`` rows per request, in order, with
        ``k_i = len(requests[i].spec_token_ids)``. ``draft_probs[i]`` ([k_i, V]) is the
        proposer's distribution of each proposal, or None for one-hot proposals."""
        device = logits.device
        logits = logits.float()  # [N, V]
        vocab = logits.shape[1]
        views: list[_RowView] = []
        starts: list[int] = []
        for r in requests:
            starts.append(len(views))
            spec, num_output = r.spec_token_ids, r.num_output_tokens
            views.extend(_RowView(r, spec[:j], num_output) for j in range(len(spec) + 1))
        if logits.shape[0] != len(views):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(views)} verification rows")
        t = SamplingTensors.from_requests(views, vocab, device)  # type: ignore[arg-type]
        processed = Sampler._process(logits, t) if t.needs_processing else logits  # [N, V]
        greedy = [r.sampling_params.temperature < SAMPLING_EPS for r in requests]
        target = processed.argmax(dim=-1)  # [N]
        probs = None if all(greedy) else processed.softmax(dim=-1)  # [N, V]
        # Proposal tokens per row (row k_i of each request proposes nothing: token 0, unused).
        proposal_rows = [tok for r in requests for tok in [*r.spec_token_ids, 0]]
        proposal = torch.tensor(proposal_rows, device=device)  # [N]
        accept = target == proposal  # [N] greedy test
        if probs is not None:
            p_d = probs.gather(1, proposal.unsqueeze(1)).squeeze(1)  # [N]
            q_d = self._draft_prob_of_proposal(requests, draft_probs, proposal, device)  # [N]
            u = self._uniforms(requests, starts, len(views), device)  # [N]
            sampled_accept = u * q_d < p_d  # [N]  u < p / q without dividing by q = 0
            rows_greedy = torch.tensor(
                [g for g, r in zip(greedy, requests) for _ in range(len(r.spec_token_ids) + 1)],
                device=device,
            )  # [N]
            accept = torch.where(rows_greedy, accept, sampled_accept)
        accept_list = accept.tolist()
        num_accepted = []
        for i, r in enumerate(requests):
            a = 0
            while a < len(r.spec_token_ids) and accept_list[starts[i] + a]:
                a += 1
            num_accepted.append(a)
        last_rows = [starts[i] + a for i, a in enumerate(num_accepted)]
        last = target[torch.tensor(last_rows, device=device)]  # [R] greedy tokens
        if probs is not None:
            random_idx = [i for i, g in enumerate(greedy) if not g]
            dist = self._final_distributions(
                probs, requests, draft_probs, starts, num_accepted, random_idx
            )  # [R_random, V]
            drawn = self._race(dist, [requests[i] for i in random_idx])  # [R_random]
            last[torch.tensor(random_idx, device=device)] = drawn
        last_list = last.tolist()
        out: list[VerifiedTokens] = []
        emitted_rows: list[int] = []
        emitted_ids: list[int] = []
        for i, r in enumerate(requests):
            a = num_accepted[i]
            ids = r.spec_token_ids[:a] + [last_list[i]]
            out.append(VerifiedTokens(ids, len(r.spec_token_ids)))
            emitted_rows.extend(range(starts[i], starts[i] + a + 1))
            emitted_ids.extend(ids)
        if any(r.sampling_params.logprobs is not None for r in requests):
            rows = torch.tensor(emitted_rows, device=device)
            owners = [r for i, r in enumerate(requests) for _ in range(num_accepted[i] + 1)]
            lps = Sampler._logprobs(
                logits.index_select(0, rows), torch.tensor(emitted_ids, device=device), owners
            )
            pos = 0
            for v in out:
                n = len(v.token_ids)
                v.logprobs = [lp for lp in lps[pos : pos + n] if lp is not None] or None
                pos += n
        return out

    @staticmethod
    def _draft_prob_of_proposal(
        requests: list[Request],
        draft_probs: list[Tensor | None] | None,
        proposal: Tensor,
        device: torch.device,
    ) -> Tensor:
        """q_j(d_{j+1}) per row ([N]); 1 for one-hot proposals (and on the bonus rows)."""
        q = torch.ones(proposal.shape, device=device)  # [N]
        if draft_probs is None:
            return q
        start = 0
        for r, dp in zip(requests, draft_probs):
            k = len(r.spec_token_ids)
            if dp is not None:
                tokens = proposal[start : start + k].unsqueeze(1)  # [k, 1]
                q[start : start + k] = dp.float().gather(1, tokens).squeeze(1)
            start += k + 1
        return q

    def _uniforms(
        self, requests: list[Request], starts: list[int], num_rows: int, device: torch.device
    ) -> Tensor:
        u = torch.rand(num_rows, device=device)  # [N] unseeded rows: the global RNG
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                k = len(r.spec_token_ids) + 1
                gen = self.sampler.generator(r, device)
                u[starts[i] : starts[i] + k] = torch.rand(k, generator=gen, device=device)
        return u

    @staticmethod
    def _final_distributions(
        probs: Tensor,
        requests: list[Request],
        draft_probs: list[Tensor | None] | None,
        starts: list[int],
        num_accepted: list[int],
        idx: list[int],
    ) -> Tensor:
        """The distribution of the token each sampled request adds ([len(idx), V]): the
        residual ``norm(max(0, p - q))`` at its first rejection, ``p`` after k accepts."""
        rows = []
        for i in idx:
            r, a = requests[i], num_accepted[i]
            p = probs[starts[i] + a]  # [V]
            if a < len(r.spec_token_ids):
                dp = draft_probs[i] if draft_probs is not None else None
                if dp is None:
                    residual = p.clone()
                    residual[r.spec_token_ids[a]] = 0.0
                else:
                    residual = (p - dp[a].float()).clamp_(min=0.0)
                # p == q leaves nothing (then rejection had probability 0): fall back to p
                p = residual if bool(residual.sum() > 0) else p
            rows.append(p)
        return torch.stack(rows)  # [len(idx), V]

    def _race(self, dist: Tensor, requests: list[Request]) -> Tensor:
        """One token per row of unnormalised ``dist`` ([n, V]) by the exponential race."""
        q = torch.empty_like(dist).exponential_()  # [n, V]
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                q[i].exponential_(generator=self.sampler.generator(r, dist.device))
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (dist / q).argmax(dim=-1)  # [n]
