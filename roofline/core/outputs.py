"""The typed contracts of one engine step.

``Scheduler.schedule()`` -> :class:`SchedulerOutput` -> ``ModelRunner.execute()`` ->
:class:`ModelRunnerOutput` -> ``Scheduler.update()`` -> list of :class:`RequestUpdate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from roofline.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed for this request in this step: positions
    ``[start_position, start_position + num_new_tokens)``."""
    block_ids: list[int]
    """The request's whole block table after this step's allocation (page ids, in order)."""
    start_position: int
    """The request's ``num_computed_tokens`` when it was scheduled (the scheduler advances the
    request by ``num_new_tokens`` once the step is decided)."""
    samples: bool
    """True when this step reaches the end of the request's tokens, so the last position's
    logits produce its next token (False for a partial prefill chunk)."""

    @property
    def token_ids(self) -> list[int]:
        """The token ids fed to the model this step that the host knows. With async
        scheduling the last one may be pending (sampled by the step still in flight): then
        this list is one shorter and the runner takes that id from the device."""
        start, end = self.start_position, self.start_position + self.num_new_tokens
        spec = self.request.spec_token_ids
        if spec:  # a verification row: the known tail, then the proposals it verifies
            known = self.request.num_known_tokens
            return self._known_ids(start, min(end, known)) + spec[: end - known]
        return self._known_ids(start, end)

    def _known_ids(self, start: int, end: int) -> list[int]:
        prompt, output = self.request.prompt_token_ids, self.request.output_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:  # decode rows: never copy the whole sequence
            return output[start - num_prompt : end - num_prompt]
        return prompt[start:] + output[: end - num_prompt]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    """Requests computed this step, in the order the runner lays out the ragged batch."""
    num_batched_tokens: int
    """Sum of ``num_new_tokens`` (never above ``max_num_batched_tokens``)."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests whose pages were taken in this ``schedule()`` call (they will recompute)."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests finished or aborted since the previous step: the runner drops their state."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token in the model's distribution."""
    top: list[tuple[int, float]]
    """The ``logprobs`` most likely (token id, logprob) pairs, most likely first."""


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    """request_id -> sampled token, for every scheduled request whose ``samples`` is True."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """request_id -> log-probabilities of the sampled token, for requests that asked."""
    verified: dict[str, VerifiedTokens] = field(default_factory=dict)
    """request_id -> what the verifier emitted, for requests scheduled with proposals (their
    ``sampled_token_ids`` entry is the last emitted token)."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    """request_id -> (prompt index of the first entry, entries) for the prompt tokens this step
    predicted, for requests with ``prompt_logprobs`` (``worker/prompt_logprobs.py``)."""


@dataclass
class VerifiedTokens:
    """The tokens one verification row emits: the accepted prefix of the proposals, then the
    target's own token (the correction at the first rejection, or the bonus when all k were
    accepted). ``len(token_ids) == num_accepted + 1``."""

    token_ids: list[int]
    num_proposed: int
    logprobs: list[TokenLogprobs] | None = None
    """One entry per emitted token, for requests that asked for logprobs."""

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@dataclass(slots=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
