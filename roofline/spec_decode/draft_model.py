"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

The draft is a full :class:`ModelRunner` (same loaders: HF folder, GGUF, dummy weights; same
attention backends; CUDA-graph decode) with its own paged KV pool, booked by its own
:class:`KVCacheManager` (prefix caching off). Each running request has a *mirror* request on the
draft side whose tokens are the request's known tokens followed by the draft's guesses. A round
first rolls the mirror back to the longest prefix it shares with the request (the accepted
guesses stay; their KV is reused), then runs ``k`` draft steps: the first computes every token
the draft has not seen (the whole prompt the first time, afterwards the accepted tokens and
the target's own token), each later one decodes the previous guess. The rounds are queued back
to back: a round's input token is the one the previous round sampled, copied on the device (the
runner's pending inputs, as under async scheduling), and the host reads all rounds' ids once at
the end. On CUDA the catch-up round replays the verification graphs (at most ``1 + k`` rows per
request) and the others the decode graphs. Drafts are greedy, so the proposal distribution q is
one-hot (the verifier's exact test is then ``u < p(d)``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ScheduledRequest, SchedulerOutput
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.proposer import Proposals
from roofline.worker.model_runner import ModelRunner, StepHandle

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_PLACEHOLDER = -1
"""A drafted token whose id is still on the device (replaced before ``propose`` returns)."""


class _Mirror:
    def __init__(self, request: Request) -> None:
        self.request = Request(request.request_id, request.prompt_token_ids, _GREEDY)
        self.num_real = 0
        """Leading output tokens known to equal the real request's."""


class DraftModelProposer:
    needs_hidden_states = False
    shadows = False
    """Its proposals cost the draft's forward passes: never asked while speculation is off."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.kv = KVCacheManager(runner.num_pages, runner.page_size, enable_prefix_caching=False)
        self._mirrors: dict[str, _Mirror] = {}
        self._finished: list[str] = []

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            mirror = self._mirrors.pop(rid, None)
            if mirror is not None:
                self.kv.free(mirror.request)
                self._finished.append(rid)

    def _sync(self, request: Request) -> Request:
        """The request's mirror, rolled back to what it shares with the request."""
        mirror = self._mirrors.get(request.request_id)
        if mirror is None:
            mirror = self._mirrors[request.request_id] = _Mirror(request)
        m, real = mirror.request, request.output_token_ids
        common = mirror.num_real
        limit = min(len(m.output_token_ids), len(real))
        while common < limit and m.output_token_ids[common] == real[common]:
            common += 1
        del m.output_token_ids[common:]
        m.output_token_ids.extend(real[common:])
        mirror.num_real = len(real)
        num_valid = min(m.num_computed_tokens, m.num_prompt_tokens + common, m.num_tokens - 1)
        m.num_computed_tokens = num_valid
        self.kv.trim(m, num_valid)
        return m

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals:
        wanted = {r.request_id: min(self.k, n) for r, n in zip(requests, max_lens)}
        mirrors = [self._sync(r) for r in requests if wanted[r.request_id] > 0]
        num_drafted = {r.request_id: 0 for r in requests}
        rounds: list[tuple[list[ScheduledRequest], StepHandle]] = []
        pending: list[Request] = []  # mirrors whose last round's token is still on the device
        active = mirrors
        for _ in range(self.k):
            active = [m for m in active if num_drafted[m.request_id] < wanted[m.request_id]]
            scheduled: list[ScheduledRequest] = []
            budget = self.runner.scheduler_config.max_num_batched_tokens
            for m in active:
                # A long catch-up (a new request's prompt) is chunked over rounds by the budget;
                # a request still catching up proposes nothing this round. After the first
                # round a mirror's input is the token the previous round sampled, still on the
                # device (pending: the runner copies it there; no host sync per round).
                num_new = min(m.num_tokens - m.num_computed_tokens, budget)
                block_ids = self.kv.allocate(m, num_new) if num_new > 0 else None
                if block_ids is None:
                    continue  # the draft pool is full: this request proposes what it has
                budget -= num_new
                start = m.num_computed_tokens
                samples = start + num_new == m.num_tokens
                scheduled.append(ScheduledRequest(m, num_new, block_ids, start, samples))
            if not scheduled:
                break
            for s in scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
            finished, self._finished = self._finished, []
            handle = self.runner.launch(
                SchedulerOutput(
                    scheduled,
                    sum(s.num_new_tokens for s in scheduled),
                    finished_request_ids=finished,
                )
            )
            rounds.append((scheduled, handle))
            _settle(pending)  # the previous round's tokens were this round's inputs
            pending = [s.request for s in scheduled if s.samples]
            for m in pending:
                m.num_pending_tokens = 1
                num_drafted[m.request_id] += 1
            active = pending
        _settle(pending)
        drafted: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for scheduled, handle in rounds:  # the rounds' ids, read once they are all queued
            out = handle.result()
            for s in scheduled:
                rid = s.request.request_id
                if s.samples:
                    drafted[rid].append(out.sampled_token_ids[rid])
        for m in mirrors:  # the placeholders become the drafted ids
            ids = drafted[m.request_id]
            if ids:
                m.output_token_ids[len(m.output_token_ids) - len(ids) :] = ids
        return Proposals([drafted[r.request_id] for r in requests])


def _settle(mirrors: list[Request]) -> None:
    """A pending drafted token becomes a known one (a placeholder until the ids are read)."""
    for m in mirrors:
        m.output_token_ids.append(_PLACEHOLDER)
        m.num_pending_tokens = 0
