"""SpecDecoder: the engine's speculative-decoding strategy object.

Once per step, before scheduling, ``propose(running)`` asks the proposer for each running
request in the decode state (prefill done, nothing pending) and stores the tokens in
``Request.spec_token_ids``; the scheduler then counts them like any other tokens and the runner
verifies them. The per-request k is clipped so that the emitted tokens (accepted + 1) never pass
``max_tokens`` or ``max_model_len``. Above ``max_batch_size`` running requests it proposes
nothing; with CUDA graphs the :class:`AdaptiveSwitch` decides per step whether to speculate and
per request who proposes (``switch.py``); while it is off, a proposer with ``shadows`` (n-gram,
the oracle) is still asked, every few steps, for a few requests' proposals that no step
verifies, and the tokens those requests then emit decide them (:meth:`SpecDecoder.shadow`): the
switch keeps knowing the acceptance without speculating. It also keeps the counters the engine
reports: proposals, accepted and emitted tokens, acceptance per position, time spent proposing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roofline.core.outputs import SchedulerOutput, VerifiedTokens
from roofline.request import Request, RequestStatus
from roofline.spec_decode.adaptive import batch_threshold
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.proposer import Proposer
from roofline.spec_decode.step_costs import calibrate
from roofline.spec_decode.switch import MAX_GRAPH_BATCH, SHADOW_REQUESTS, AdaptiveSwitch

if TYPE_CHECKING:
    from roofline.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    """Verification rows (one per request per speculative step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_rejections: int = 0
    """Verifications that rejected a proposal (the i.i.d. alpha is accepted / (accepted +
    rejections): the proposals after a rejection are never tried)."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """[k] how often the proposal at position i was accepted."""
    propose_s: float = 0.0
    num_propose_calls: int = 0
    shadow_s: float = 0.0
    """Host time of shadow proposals (speculation off; ``SpecDecoder.shadow``)."""

    def as_engine_stats(self) -> dict[str, object]:
        """The ``EngineStats`` fields (``/metrics`` reads them)."""
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens_total": self.num_emitted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }

    def summary(self) -> str:
        """One line for ``roofline bench`` output."""
        per_pos = [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []
        ms = 1e3 * self.propose_s / self.num_propose_calls if self.num_propose_calls else 0.0
        return (
            f"speculative decoding: {self.num_drafts} verifications, "
            f"{self.num_draft_tokens} proposed, {self.num_accepted_tokens} accepted "
            f"({100 * self.acceptance_rate:.1f}%), mean accepted length "
            f"{self.mean_accepted_length:.2f} tokens per verification, acceptance per "
            f"position [{', '.join(f'{x:.2f}' for x in per_pos)}], proposing {ms:.2f} ms "
            "per step"
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification row (accepted + the target's own)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_batch_size: int,
        max_model_len: int,
        alpha_prior: float = 0.6,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_batch_size = max_batch_size
        """Speculate only while at most this many requests run (the adaptive switch)."""
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._proposed: list[Request] = []
        self.alpha_prior = alpha_prior
        """Acceptance rate assumed before any is measured (the oracle's own alpha)."""
        self.switch: AdaptiveSwitch | None = None
        """The adaptive switch (CUDA graphs); None: the roofline threshold alone."""
        self._num_proposed = 0
        """Tokens proposed in the current step (0: it verifies nothing)."""
        self.calibration = None
        """The start-up step costs (``step_costs.Calibration``), with CUDA graphs."""
        self._shadows: list[tuple[Request, int, list[int]]] = []
        """Shadow proposals waiting for their tokens: (request, output length when proposed,
        proposals)."""
        self._shadow_next = 0
        """Round-robin position in the running list of the next shadow round."""

    def prepare(self, runner: ModelRunner) -> None:
        """After the target's decode graphs exist: capture the verification graphs (target and
        draft) and measure the step times the switch starts from."""
        draft = getattr(self.proposer, "runner", None)
        max_batch = min(MAX_GRAPH_BATCH, runner.scheduler_config.max_num_seqs)
        if self.config.disable_by_batch_size is not None:
            max_batch = min(max(self.config.disable_by_batch_size, 1), max_batch)
        cal = calibrate(runner, self.config.num_speculative_tokens, max_batch, draft)
        if cal is not None:
            self.calibration = cal
            self.switch = AdaptiveSwitch(
                self.config.num_speculative_tokens,
                cal.plain,
                cal.spec,
                self.alpha_prior,
                shadows=bool(getattr(self.proposer, "shadows", False)),
            )
            for b, tp, ts, gain in self.switch.table():
                logger.info(
                    "spec decode b=%d: plain %.3f ms, speculative %.3f ms (context %d), "
                    "predicted gain %.2fx", b, 1e3 * tp, 1e3 * ts, self.switch.context_len, gain,
                )  # fmt: skip
        if self.switch is None and self.config.disable_by_batch_size is None:
            self.max_batch_size = batch_threshold(  # no graphs to measure: the roofline
                runner.model_config,
                None if draft is None else draft.model_config,
                runner.device,
                self.alpha_prior,
                self.config.num_speculative_tokens,
                runner.scheduler_config.max_num_seqs,
                runner.dtype,
            )

    def max_sampled_rows(self, max_num_seqs: int, graphs: bool) -> int:
        """Logits rows a step may compute (the target's KV budget leaves room for them):
        1 + k per request up to the largest batch that may speculate (at most the largest
        verification graph with CUDA graphs), 1 per request beyond."""
        batch = min(self.max_batch_size, max_num_seqs)
        if graphs:
            batch = min(batch, MAX_GRAPH_BATCH)
        return max(max_num_seqs, batch * (1 + self.config.num_speculative_tokens))

    def active(self, num_running: int, running: list[Request]) -> bool:
        """Whether the next step speculates (``running``: the scheduler's running list)."""
        if not 0 < num_running <= self.max_batch_size:
            return False
        switch = self.switch
        if switch is None:
            return True
        if self._shadows:
            self._check_shadows()
        on = switch.choose(running)
        if not on and switch.shadow_due():
            self.shadow(running)
        return on

    def shadow(self, running: list[Request]) -> None:
        """Ask up to ``SHADOW_REQUESTS`` decoding requests (round robin) for proposals that no
        step verifies; the tokens they emit next decide them (``_check_shadows``)."""
        t0 = time.perf_counter()
        n = len(running)
        busy = {r.request_id for r, _, _ in self._shadows}
        requests: list[Request] = []
        max_lens: list[int] = []
        k = self.config.num_speculative_tokens
        start = self._shadow_next % max(n, 1)
        for i in range(min(n, SHADOW_REQUESTS)):
            r = running[(start + i) % n]
            if (
                r.status is not RequestStatus.RUNNING
                or not r.output_token_ids
                or r.request_id in busy
            ):
                continue
            room = min(
                r.max_tokens - r.num_output_tokens - 1,
                self.max_model_len - r.num_known_tokens - 1,
                k,
            )
            if room > 0:
                requests.append(r)
                max_lens.append(room)
        self._shadow_next = start + SHADOW_REQUESTS
        if requests:
            proposals = self.proposer.propose(requests, max_lens)
            switch = self.switch
            switch.shadowed()  # type: ignore[union-attr]
            for r, tokens, m in zip(requests, proposals.token_ids, max_lens):
                tokens = list(tokens[:m])
                switch.proposed(r.request_id, len(tokens), m)  # type: ignore[union-attr]
                if tokens:
                    self._shadows.append((r, r.num_output_tokens, tokens))
        self.stats.shadow_s += time.perf_counter() - t0

    def _check_shadows(self) -> None:
        """Decide the shadow proposals whose tokens have arrived, as a greedy verification
        would: the accepted prefix is the run of proposals equal to the emitted tokens."""
        switch = self.switch
        waiting: list[tuple[Request, int, list[int]]] = []
        decided = False
        for r, start, tokens in self._shadows:
            out = r.output_token_ids
            known = min(len(out) - start, len(tokens))  # emitted since, up to the proposals
            accepted = 0
            while accepted < known and out[start + accepted] == tokens[accepted]:
                accepted += 1
            if accepted < known or accepted == len(tokens):
                switch.record(r.request_id, accepted, len(tokens))  # type: ignore[union-attr]
                switch.num_shadowed += 1  # type: ignore[union-attr]
                decided = True
            elif r.status is RequestStatus.RUNNING:
                waiting.append((r, start, tokens))  # its tokens are still to come
        self._shadows = waiting
        if decided:
            switch.shadows_decided()  # type: ignore[union-attr]

    @staticmethod
    def is_decode_step(sched_out: SchedulerOutput, speculated: bool) -> bool:
        """Every scheduled request decodes (its token, and its proposals if any); O(1) for a
        step without proposals (each request has at least one token)."""
        if not speculated:
            return sched_out.num_batched_tokens == len(sched_out.scheduled)
        return all(
            s.num_new_tokens == 1 + len(s.request.spec_token_ids) for s in sched_out.scheduled
        )

    def observe(self, speculated: bool, num_running: int, seconds: float | None) -> None:
        """An engine step's wall time (the switch's online cost measure; None: not a steady
        decode-only step); a speculative step in which nobody proposed is neither mode's cost."""
        if self.switch is not None:
            steady = seconds is not None and not (speculated and not self._num_proposed)
            self.switch.observe(speculated, num_running, seconds if steady else None)

    def withdraw(self) -> None:
        """Drop proposals that no step verified (a request the token budget did not reach):
        before proposing again, and on every step while speculation is off, so an async
        (non-speculative) step never sees them."""
        for r in self._proposed:
            if r.spec_token_ids:
                r.spec_token_ids = []
        self._proposed = []
        self._num_proposed = 0

    def propose(self, running: list[Request]) -> None:
        t0 = time.perf_counter()
        self.withdraw()
        requests: list[Request] = []
        max_lens: list[int] = []
        switch = self.switch
        wants = switch.wants if switch is not None else None
        k, max_len, running_status = (
            self.config.num_speculative_tokens,
            self.max_model_len,
            RequestStatus.RUNNING,
        )
        for r in running:  # once per running request per speculative step: kept lean
            num_known = len(r.prompt_token_ids) + len(r.output_token_ids)
            if (
                r.status is not running_status
                or r.num_pending_tokens
                or r.num_computed_tokens != num_known - 1
            ):
                continue  # still prefilling, or its last token is in flight
            if wants is not None and not wants(r.request_id):
                continue  # its acceptance does not pay for its rows: plain decoding
            room = min(r.max_tokens - len(r.output_token_ids), max_len - num_known) - 1
            if room > 0:
                requests.append(r)
                max_lens.append(room if room < k else k)
        if requests:
            proposals = self.proposer.propose(requests, max_lens)
            num_proposed = 0
            for r, tokens, n in zip(requests, proposals.token_ids, max_lens):
                tokens = list(tokens[:n])
                r.spec_token_ids = tokens
                num_proposed += len(tokens)
                if switch is not None:
                    switch.proposed(r.request_id, len(tokens), n)
            self._num_proposed += num_proposed
            self._proposed = requests
        self.stats.propose_s += time.perf_counter() - t0
        self.stats.num_propose_calls += 1

    def record(self, verified: dict[str, VerifiedTokens]) -> None:
        """Count a step's verification rows (``ModelRunnerOutput.verified``)."""
        s = self.stats
        switch = self.switch
        for rid, v in verified.items():
            if switch is not None:
                switch.record(rid, v.num_accepted, v.num_proposed)
            s.num_drafts += 1
            s.num_draft_tokens += v.num_proposed
            s.num_accepted_tokens += v.num_accepted
            s.num_emitted_tokens += v.num_accepted + 1
            s.num_rejections += v.num_accepted < v.num_proposed
            for i in range(v.num_accepted):
                s.accepted_per_pos[i] += 1

    def remove(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if self._shadows:
            gone = set(ids)
            self._shadows = [s for s in self._shadows if s[0].request_id not in gone]
        self.proposer.remove(ids)
        if self.switch is not None:
            self.switch.forget(ids)
