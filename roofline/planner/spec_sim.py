"""Speculative decoding in the serving simulator: the engine's own ``SpecDecoder`` and adaptive
switch, with a proposer whose tokens are accepted at a given rate.

The simulator's fake runner samples one fixed token, so no real proposer could be judged; what
matters to a plan is how many tokens a verification row emits and what the step costs. Each
proposal here is accepted with probability ``acceptance_rate`` independently, up to the first
rejection (the model behind ``planner/specdec.py``: ``E[tokens per row] = (1 - a^(k+1)) /
(1 - a)``), drawn from a seeded generator. A verification row is priced as the engine runs it
(``planner.specdec.verify_shape``: ``1 + k`` decode rows through the GEMMs, the request's KV
read once; :func:`verification_shape` below), a draft model adds ``k`` decode steps of
``draft_cost_ratio`` times the target's decode step for the proposing rows, and a speculative
step, which the engine runs synchronously, adds its host time (``host_s + host_per_request_s
x running``; default the engine's priors, ``spec_decode/step_costs.py``).

With ``adaptive`` (the engine's default with CUDA graphs) the engine's :class:`AdaptiveSwitch`
decides each step, priced from the same step model at two contexts as the engine's start-up
calibration prices its graphs, with the engine's prior acceptance (0.6), learning the
acceptance from verifications and, while off, from shadow proposals (no draft model: n-gram),
and the step costs from the simulated step times; without it speculation runs whenever at most
``max_batch_size`` requests run.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from roofline.core.outputs import SchedulerOutput, VerifiedTokens
from roofline.planner.calibration import StepShape, StepTimer
from roofline.planner.specdec import plain_shape, verify_shape
from roofline.request import Request, RequestStatus
from roofline.spec_decode.adaptive import ASSUMED_ACCEPTANCE
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.decoder import SpecDecoder
from roofline.spec_decode.proposer import Proposals
from roofline.spec_decode.step_costs import (
    CONTEXTS,
    SPEC_HOST_PER_REQUEST_S,
    SPEC_HOST_S,
    StepCosts,
)
from roofline.spec_decode.switch import MAX_GRAPH_BATCH, AdaptiveSwitch
from roofline.worker.cuda_graph import batch_buckets


@dataclass(frozen=True)
class SpecSimConfig:
    num_speculative_tokens: int
    acceptance_rate: float
    """Probability that each proposal is accepted (given the ones before it were)."""
    draft_cost_ratio: float = 0.0
    """One draft decode step over one target decode step of the same rows (0: n-gram)."""
    max_batch_size: int = 1 << 30
    """Speculate only while at most this many requests run (``disable_by_batch_size``)."""
    seed: int = 0
    adaptive: bool = True
    """The engine's adaptive switch decides each step (else: always, up to max_batch_size)."""
    host_s: float = SPEC_HOST_S
    """Host seconds a synchronous speculative step adds..."""
    host_per_request_s: float = SPEC_HOST_PER_REQUEST_S
    """...and per running request."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an integer >= 1")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError("acceptance_rate must lie in [0, 1]")
        if self.draft_cost_ratio < 0:
            raise ValueError("draft_cost_ratio must be >= 0")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.host_s < 0 or self.host_per_request_s < 0:
            raise ValueError("host_s and host_per_request_s must be >= 0")


class _FixedProposer:
    """Proposes ``token_id`` as far as each request allows (acceptance is drawn later)."""

    needs_hidden_states = False
    shadows = True

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def propose(self, requests: list[Request], max_lens: list[int], hidden_states=None):
        return Proposals([[self.token_id] * n for n in max_lens])

    def remove(self, request_ids: Iterable[str]) -> None:
        pass


def _draw(rng: random.Random, alpha: float, k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


class _SimDecoder(SpecDecoder):
    """The engine's decoder whose shadow proposals are decided by draws at the acceptance rate
    (the fake runner's tokens always equal the fixed proposals), once their tokens are out."""

    rng: random.Random
    alpha: float

    def _check_shadows(self) -> None:
        waiting = []
        decided = False
        for r, start, tokens in self._shadows:
            if len(r.output_token_ids) - start >= len(tokens):
                accepted = _draw(self.rng, self.alpha, len(tokens))
                self.switch.record(r.request_id, accepted, len(tokens))  # type: ignore[union-attr]
                self.switch.num_shadowed += 1  # type: ignore[union-attr]
                decided = True
            elif r.status is RequestStatus.RUNNING:
                waiting.append((r, start, tokens))
        self._shadows = waiting
        if decided:
            self.switch.shadows_decided()  # type: ignore[union-attr]


def verification_shape(sched_out: SchedulerOutput, page_size: int) -> StepShape | None:
    """A step with verification rows as the engine runs it (each ``1 + k`` row request a
    multi-query decode over its context, KV read once); None when nothing is verified."""
    rows = [s for s in sched_out.scheduled if s.request.spec_token_ids]
    if not rows:
        return None
    num_decode = ctx_sum = shared = 0
    chunks: list[tuple[int, int]] = []
    holders: Counter[int] = Counter()
    for s in sched_out.scheduled:
        n, start = s.num_new_tokens, s.start_position
        if s.request.spec_token_ids or n == 1:
            num_decode += n
            ctx_sum += n * (start + 1)
            shared += (n - 1) * (start + 1)
            holders.update(s.block_ids)
        else:
            chunks.append((n, start))
    shared += page_size * sum(m - 1 for m in holders.values() if m > 1)
    return StepShape(num_decode, ctx_sum, tuple(chunks), min(shared, ctx_sum - num_decode))


class SimSpeculator:
    """What the simulator's step loop calls around ``schedule()`` when speculation is on."""

    def __init__(
        self,
        config: SpecSimConfig,
        token_id: int,
        max_model_len: int,
        timer: StepTimer | None = None,
        max_num_seqs: int = MAX_GRAPH_BATCH,
    ) -> None:
        self.config = config
        self.token_id = token_id
        k = config.num_speculative_tokens
        engine_config = SpeculativeConfig("ngram", k)
        self.decoder = _SimDecoder(
            engine_config,
            _FixedProposer(token_id),
            config.max_batch_size,
            max_model_len,
            ASSUMED_ACCEPTANCE,
        )
        self._rng = random.Random(config.seed)
        self.decoder.rng, self.decoder.alpha = self._rng, config.acceptance_rate
        self.num_spec_steps = 0
        self._speculated = False
        self._num_running = 0
        if config.adaptive and timer is not None:
            self.decoder.switch = self._switch(timer, min(max_num_seqs, config.max_batch_size))
            self.decoder.max_batch_size = min(config.max_batch_size, MAX_GRAPH_BATCH)

    def _switch(self, timer: StepTimer, max_batch: int) -> AdaptiveSwitch:
        """The engine's switch, its start-up costs priced by ``timer`` at two contexts."""
        k, ratio = self.config.num_speculative_tokens, self.config.draft_cost_ratio
        buckets = batch_buckets(min(max_batch, MAX_GRAPH_BATCH))
        c0, c1 = CONTEXTS
        plain = [{b: timer(plain_shape(b, c)) for b in buckets} for c in (c0, c1)]
        spec = [{b: timer(verify_shape(b, k, c)) + k * ratio * plain[i][b] for b in buckets}
                for i, c in enumerate((c0, c1))]  # fmt: skip
        return AdaptiveSwitch(
            k,
            StepCosts.from_contexts(*plain, c0, c1),
            StepCosts.from_contexts(*spec, c0, c1),
            ASSUMED_ACCEPTANCE,
            (self.config.host_s, self.config.host_per_request_s),
            shadows=ratio == 0.0,
        )

    def before_schedule(self, running: list[Request], num_running: int) -> None:
        self._num_running = num_running
        self._speculated = self.decoder.active(num_running, running)
        if self._speculated:
            self.decoder.propose(running)
        else:
            self.decoder.withdraw()

    def step_time_s(self, sched_out: SchedulerOutput, timer: StepTimer, page_size: int) -> float:
        """A step with verification rows: the rows as the engine runs them, the draft's steps
        and the synchronous step's host time (0 when the step verifies nothing)."""
        shape = verification_shape(sched_out, page_size)
        if shape is None:
            return 0.0
        self.num_spec_steps += 1
        host = self.config.host_s + self.config.host_per_request_s * len(sched_out.scheduled)
        return timer(shape) + self.draft_time_s(sched_out, timer) + host

    def observe(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """The step's simulated time is the switch's online measure (decode-only steps)."""
        decode_only = self.decoder.is_decode_step(sched_out, self._speculated)
        steady = seconds if decode_only else None
        self.decoder.observe(self._speculated, self._num_running, steady)

    def verify(self, sched_out: SchedulerOutput) -> dict[str, VerifiedTokens]:
        """Draw each verification row's accepted run (its proposals are the request's
        ``spec_token_ids`` as scheduled)."""
        alpha = self.config.acceptance_rate
        verified: dict[str, VerifiedTokens] = {}
        for s in sched_out.scheduled:
            k = len(s.request.spec_token_ids)
            if not s.samples or not k:
                continue
            accepted = _draw(self._rng, alpha, k)
            verified[s.request.request_id] = VerifiedTokens([self.token_id] * (accepted + 1), k)
        self.decoder.record(verified)
        return verified

    def draft_time_s(self, sched_out: SchedulerOutput, timer: StepTimer) -> float:
        """The draft model's ``k`` decode steps for the step's verification rows."""
        ratio = self.config.draft_cost_ratio
        rows = [s for s in sched_out.scheduled if s.request.spec_token_ids]
        if not ratio or not rows:
            return 0.0
        ctx = sum(s.start_position + 1 for s in rows)
        k = max(len(s.request.spec_token_ids) for s in rows)
        return ratio * k * timer(StepShape(len(rows), ctx))
