"""The messages between the API process and the engine core (:mod:`roofline.engine.core`).

Commands flow to the core (:class:`AddRequest`, :class:`AddRequests`, :class:`AbortRequests`,
:class:`Shutdown`);
the core answers with :class:`CoreReady` once, then :class:`CoreOutputs` per loop iteration, or
:class:`CoreFailed`. All are dataclasses, pickled over a pipe; the per-step delta outputs travel
as plain tuples (:func:`pack_outputs`), the one hot payload.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from roofline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from roofline.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    """``time.monotonic()`` in the API process (the same clock in every process on Linux)."""
    prompt_text: str | None


@dataclass
class AddRequests:
    """The sub-requests of one client request (its prompts): admitted together, in one loop
    iteration, or none of them (the first failure is every one's verdict)."""

    requests: list[AddRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class CoreReady:
    """The first message of a healthy core: the facts the API process serves from."""

    model_name: str
    max_model_len: int
    vocab_size: int
    pid: int


@dataclass
class CoreFailed:
    """The engine could not be built, or a step raised; the core stops after sending it."""

    error: BaseException


@dataclass
class CoreOutputs:
    """One loop iteration's news."""

    stats: Any
    """The engine's ``EngineStats`` after this iteration."""
    now: float
    """``time.monotonic()`` when the outputs were made (the ITL metric's clock)."""
    added: list[tuple[str, BaseException | None]] = field(default_factory=list)
    """(request id, None if accepted, else what ``LLMEngine.add_request`` raised)."""
    outputs: list[tuple] = field(default_factory=list)
    """Delta outputs in wire form (:func:`pack_outputs`)."""


Command = AddRequest | AddRequests | AbortRequests | Shutdown


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """Delta outputs as plain tuples, without the prompt: pickling them costs the core half of
    what the dataclasses cost (and the API process a quarter), per step, per running request.
    Row: ``(request_id, finished, completions, metrics, num_cached_tokens, error,
    prompt_logprobs)``, completions as ``CompletionOutput``'s fields in order, metrics as
    ``RequestMetrics``'s (or None)."""
    rows = []
    for o in outputs:
        m = o.metrics
        rows.append(
            (
                o.request_id,
                o.finished,
                [
                    (
                        c.index,
                        c.text,
                        c.token_ids,
                        c.cumulative_logprob,
                        c.logprobs,
                        c.finish_reason,
                        c.stop_reason,
                    )
                    for c in o.outputs
                ],
                None
                if m is None
                else (
                    m.arrival_time,
                    m.first_scheduled_time,
                    m.first_token_time,
                    m.last_token_time,
                    m.finished_time,
                    m.num_cached_tokens,
                    m.num_preemptions,
                ),
                o.num_cached_tokens,
                o.error,
                o.prompt_logprobs,
            )
        )
    return rows


def unpack_outputs(rows: list[tuple]) -> list[RequestOutput]:
    """The inverse of :func:`pack_outputs` (``prompt`` None, ``prompt_token_ids`` empty)."""
    return [
        RequestOutput(
            request_id,
            None,
            [],
            [CompletionOutput(*c) for c in completions],
            finished,
            None if metrics is None else RequestMetrics(*metrics),
            num_cached,
            error,
            prompt_lps,
        )
        for request_id, finished, completions, metrics, num_cached, error, prompt_lps in rows
    ]


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
