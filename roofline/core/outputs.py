"""The typed contracts of one engine step.

``Scheduler.schedule()`` -> :class:`SchedulerOutput` -> ``ModelRunner.launch()`` (its
handle's ``result()``; ``execute()`` is both at once) ->
:class:`ModelRunnerOutput` -> ``Scheduler.update()`` -> list of :class:`RequestUpdate`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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


class SchedulerOutput:
    """One step's plan, array-shaped: entry ``i`` of ``requests``, ``num_new_tokens``,
    ``block_ids``, ``start_positions`` and ``samples`` is one scheduled request (the fields of
    :class:`ScheduledRequest`), in the order the runner lays out the ragged batch. The scheduler
    appends to these lists once per request per step, which costs a fraction of building an
    object per request; the per-step loops (the host batch, ``Scheduler.update``) walk them
    with ``zip``. ``scheduled`` gives the same plan as :class:`ScheduledRequest` objects, built
    on first use, for the code that wants them (speculative decoding, tests, the planner); it
    may also be given instead of the lists."""

    __slots__ = (
        "requests",
        "num_new_tokens",
        "block_ids",
        "start_positions",
        "samples",
        "num_batched_tokens",
        "preempted_request_ids",
        "finished_request_ids",
        "_scheduled",
        "advances",
        "changed_rows",
        "inputs_pending",
    )

    def __init__(
        self,
        scheduled: list[ScheduledRequest] | None = None,
        num_batched_tokens: int = 0,
        preempted_request_ids: list[str] | None = None,
        finished_request_ids: list[str] | None = None,
        *,
        rows: tuple[list[Request], list[int], list[list[int]], list[int], list[bool]] | None = None,
    ) -> None:
        if rows is None:
            scheduled = scheduled or []
            rows = (
                [s.request for s in scheduled],
                [s.num_new_tokens for s in scheduled],
                [s.block_ids for s in scheduled],
                [s.start_position for s in scheduled],
                [s.samples for s in scheduled],
            )
        elif scheduled is not None:
            raise ValueError("give the scheduled requests as entries or as rows, not both")
        self.requests, self.num_new_tokens, self.block_ids, self.start_positions, self.samples = (
            rows
        )
        self._scheduled = scheduled
        self.num_batched_tokens = num_batched_tokens
        """Sum of ``num_new_tokens`` (never above ``max_num_batched_tokens``)."""
        self.preempted_request_ids = preempted_request_ids if preempted_request_ids else []
        """Requests whose pages were taken in this ``schedule()`` call (they will recompute)."""
        self.finished_request_ids = finished_request_ids if finished_request_ids else []
        """Requests finished or aborted since the previous step: the runner drops their state."""
        self.advances: SchedulerOutput | None = None
        """Set by a steady decode step (``core/steady.py``): the step this one moves on by one
        token per request (the same requests in the same order, each start one further), so
        the runner may advance its per-row state instead of rebuilding it."""
        self.changed_rows: list[int] | None = None
        """A steady decode step's rows whose ``block_ids`` may have changed since the step it
        advances (None: not a steady step; kept after ``advances`` is cleared)."""
        self.inputs_pending = False
        """With ``advances``: every row's input token is pending (sampled by the step before,
        not folded in yet: async scheduling)."""

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Requests computed this step, in the order the runner lays out the ragged batch."""
        if self._scheduled is None:
            self._scheduled = list(
                map(
                    ScheduledRequest,
                    self.requests,
                    self.num_new_tokens,
                    self.block_ids,
                    self.start_positions,
                    self.samples,
                )
            )
        return self._scheduled

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def view(self, num_rows: int | None = None) -> ScheduledView:
        """The first ``num_rows`` (all) scheduled requests as a sequence of
        :class:`ScheduledRequest` that builds them only when read (its length is free)."""
        return ScheduledView(self, len(self.requests) if num_rows is None else num_rows)

    def reordered(self, order: list[int]) -> SchedulerOutput:
        """The same plan with its requests in ``order`` (indices into this one's)."""
        rows = tuple(
            [values[i] for i in order]
            for values in (
                self.requests,
                self.num_new_tokens,
                self.block_ids,
                self.start_positions,
                self.samples,
            )
        )
        return SchedulerOutput(
            None,
            self.num_batched_tokens,
            self.preempted_request_ids,
            self.finished_request_ids,
            rows=rows,  # type: ignore[arg-type]
        )

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput({self.scheduled!r}, num_batched_tokens={self.num_batched_tokens}, "
            f"preempted_request_ids={self.preempted_request_ids}, "
            f"finished_request_ids={self.finished_request_ids})"
        )


class ScheduledView(Sequence[ScheduledRequest]):
    """The first ``num_rows`` requests of a ``SchedulerOutput`` as :class:`ScheduledRequest`
    objects, built on first read: a consumer that often needs only the count (the shared-prefix
    detector between its rescans) costs nothing per row then."""

    def __init__(self, out: SchedulerOutput, num_rows: int) -> None:
        self._out, self._num_rows = out, num_rows
        self._rows: list[ScheduledRequest] | None = None

    def rows(self) -> list[ScheduledRequest]:
        if self._rows is None:
            rows = self._out.scheduled
            self._rows = rows if self._num_rows == len(rows) else rows[: self._num_rows]
        return self._rows

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index):  # type: ignore[override]
        return self.rows()[index]

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self.rows())


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token in the model's distribution."""
    top: list[tuple[int, float]]
    """The ``logprobs`` most likely (token id, logprob) pairs, most likely first."""


class ModelRunnerOutput:
    """What a step sampled. ``sampled_token_ids`` maps request ids to their tokens; a runner
    that laid the step's sampling requests out in their ``SchedulerOutput`` order may give the
    ids as a list instead (``token_ids`` with ``request_ids``), which ``Scheduler.update`` walks
    by position: the dict is then built only if something reads it."""

    __slots__ = ("_sampled", "logprobs", "verified", "prompt_logprobs", "token_ids", "request_ids")

    def __init__(
        self,
        sampled_token_ids: dict[str, int] | None = None,
        logprobs: dict[str, TokenLogprobs] | None = None,
        verified: dict[str, VerifiedTokens] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
        *,
        token_ids: list[int] | None = None,
        request_ids: list[str] | None = None,
    ) -> None:
        if (token_ids is None) != (request_ids is None):
            raise ValueError("token_ids and request_ids come together")
        if token_ids is not None and sampled_token_ids is not None:
            raise ValueError("give the sampled ids as a dict or as lists, not both")
        self._sampled = sampled_token_ids
        self.logprobs: dict[str, TokenLogprobs] = {} if logprobs is None else logprobs
        """request_id -> log-probabilities of the sampled token, for requests that asked."""
        self.verified: dict[str, VerifiedTokens] = {} if verified is None else verified
        """request_id -> what the verifier emitted, for requests scheduled with proposals
        (their ``sampled_token_ids`` entry is the last emitted token)."""
        self.prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = (
            {} if prompt_logprobs is None else prompt_logprobs
        )
        """request_id -> (prompt index of the first entry, entries) for the prompt tokens this
        step predicted, for requests with ``prompt_logprobs`` (``worker/prompt_logprobs.py``)."""
        self.token_ids = token_ids
        """The sampled ids in the order of the step's sampling requests (its
        ``SchedulerOutput`` entries with ``samples``), or None (read ``sampled_token_ids``)."""
        self.request_ids = request_ids
        """The request id of each entry of ``token_ids``."""

    @property
    def sampled_token_ids(self) -> dict[str, int]:
        """request_id -> sampled token, for every scheduled request whose ``samples`` is True."""
        if self._sampled is None:
            ids = self.token_ids
            self._sampled = {} if ids is None else dict(zip(self.request_ids, ids))  # type: ignore[arg-type]
        return self._sampled

    def __repr__(self) -> str:
        return (
            f"ModelRunnerOutput({self.sampled_token_ids!r}, logprobs={self.logprobs!r}, "
            f"verified={self.verified!r}, prompt_logprobs={self.prompt_logprobs!r})"
        )


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
