"""Speculative decoding in the serving simulator: the engine's own ``SpecDecoder`` with a
proposer whose tokens are accepted at a given rate.

The simulator's fake runner samples one fixed token, so no real proposer could be judged; what
matters to a plan is how many tokens a verification row emits and what the step costs. Each
proposal here is accepted with probability ``acceptance_rate`` independently, up to the first
rejection (the model behind ``planner/specdec.py``: ``E[tokens per row] = (1 - a^(k+1)) /
(1 - a)``), drawn from a seeded generator. A verification row is a ``1 + k``-token chunk over
its cached context in the step shape (what the engine's runner computes for it), and a draft
model adds ``k`` decode steps of ``draft_cost_ratio`` times the target's decode step for the
proposing rows. The adaptive switch is the engine's: speculation runs while at most
``max_batch_size`` requests run.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from roofline.core.outputs import SchedulerOutput, VerifiedTokens
from roofline.planner.calibration import StepShape, StepTimer
from roofline.request import Request
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.decoder import SpecDecoder
from roofline.spec_decode.proposer import Proposals


@dataclass(frozen=True)
class SpecSimConfig:
    num_speculative_tokens: int
    acceptance_rate: float
    """Probability that each proposal is accepted (given the ones before it were)."""
    draft_cost_ratio: float = 0.0
    """One draft decode step over one target decode step of the same rows (0: n-gram)."""
    max_batch_size: int = 1 << 30
    """Speculate only while at most this many requests run (the engine's adaptive switch)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an integer >= 1")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError("acceptance_rate must lie in [0, 1]")
        if self.draft_cost_ratio < 0:
            raise ValueError("draft_cost_ratio must be >= 0")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")


class _FixedProposer:
    """Proposes ``token_id`` as far as each request allows (acceptance is drawn later)."""

    needs_hidden_states = False

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def propose(self, requests: list[Request], max_lens: list[int], hidden_states=None):
        return Proposals([[self.token_id] * n for n in max_lens])

    def remove(self, request_ids: Iterable[str]) -> None:
        pass


class SimSpeculator:
    """What the simulator's step loop calls around ``schedule()`` when speculation is on."""

    def __init__(self, config: SpecSimConfig, token_id: int, max_model_len: int) -> None:
        self.config = config
        self.token_id = token_id
        engine_config = SpeculativeConfig("ngram", config.num_speculative_tokens)
        self.decoder = SpecDecoder(
            engine_config, _FixedProposer(token_id), config.max_batch_size, max_model_len
        )
        self._rng = random.Random(config.seed)

    def before_schedule(self, running: list[Request], num_running: int) -> None:
        if self.decoder.active(num_running, running):
            self.decoder.propose(running)
        else:
            self.decoder.withdraw()

    def verify(self, sched_out: SchedulerOutput) -> dict[str, VerifiedTokens]:
        """Draw each verification row's accepted run (its proposals are the request's
        ``spec_token_ids`` as scheduled)."""
        alpha = self.config.acceptance_rate
        verified: dict[str, VerifiedTokens] = {}
        for s in sched_out.scheduled:
            k = len(s.request.spec_token_ids)
            if not s.samples or not k:
                continue
            accepted = 0
            while accepted < k and self._rng.random() < alpha:
                accepted += 1
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
