"""A request's logical state: its tokens, how many of them sit in the KV cache, its status.

The scheduler and the KV cache manager work on these objects and never on tensors. One
``Request`` is one sequence: a prompt with ``n > 1`` becomes ``n`` requests (``Request.parent``
links the forks to the first one so they can share its prompt pages).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from roofline.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Back in the waiting queue after its pages were taken; it recomputes on resumption."""
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str) -> None:
        self.finished = value in ("stop", "length", "abort", "error")
        """Whether this status ends the request (a plain attribute: read every step for
        every request)."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    """Token ids that end the request (empty when ``ignore_eos``)."""
    max_tokens: int = 16
    """Resolved cap on new tokens (the params' max_tokens clipped to the model length)."""
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    """Lower runs first under the ``priority`` policy."""
    parent: Request | None = None
    """For the 2nd..nth completion of an ``n > 1`` prompt: the request whose prompt pages it
    shares once they are computed."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache or being written by a launched step (prompt and
    output). The scheduler advances it when it schedules a step."""
    num_pending_tokens: int = 0
    """Output tokens a launched step is sampling whose values the host has not received yet
    (at most 2 with async scheduling: one per step in flight). They count in ``num_tokens`` but
    not in ``output_token_ids``; ``Scheduler.update`` turns them into real tokens in order."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens (speculative decoding) this request's next step verifies. They count in
    ``num_tokens`` (the step computes them) but are not output until the verifier accepts them;
    ``Scheduler.update`` clears them."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was (last) admitted."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    quiet: bool = False
    """Nobody reads this request's tokens before it finishes (no streaming, logprobs, stop
    strings or grammar): ``Scheduler.update`` reports it only on its first token, on a
    verification row and when it finishes, and counts its other tokens in
    ``Scheduler.num_unreported_tokens`` (no per-step update object)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        p = self.sampling_params
        self.argmax_only = (
            p.temperature < 1e-5  # (the sampler's SAMPLING_EPS)
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and not p.min_tokens
            and p.logprobs is None
        )
        """Its token is always the raw logits' argmax and nothing else is asked of them (greedy,
        no penalties, no ``min_tokens``, no logprobs): the sampler checks this one flag per row
        (its sampling params are not changed once the request is made)."""
        self.stop_check_ids = (
            self.eos_token_ids | frozenset(p.stop_token_ids)
            if p.stop_token_ids
            else self.eos_token_ids
        )
        """EOS and stop token ids together: a sampled token outside them cannot stop the
        request (``Scheduler.update`` reads this one set per token)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, pending and proposed ones included: the length the next
        step extends."""
        return (
            len(self.prompt_token_ids)
            + len(self.output_token_ids)
            + self.num_pending_tokens
            + len(self.spec_token_ids)
        )

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens whose ids the host knows (``len(all_token_ids)``)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids the host knows (pending tokens excluded)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def is_finished(self) -> bool:
        return self.status.finished
