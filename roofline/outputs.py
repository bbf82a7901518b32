"""What the offline API and the engine hand back to users (vLLM's names and shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Logprob(NamedTuple):
    logprob: float
    rank: int
    """1-based rank in the model's distribution."""
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    """Which of the prompt's ``n`` completions this is."""
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """One dict per generated token: the top-``logprobs`` tokens plus the sampled one."""
    finish_reason: str | None = None
    """``stop`` (EOS, stop token or stop string), ``length``, ``abort`` or ``error``;
    None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, if any."""
    tool_calls: list[dict[str, Any]] | None = None
    """``LLM.chat(tools=...)``: the calls parsed from ``text`` (OpenAI-shaped: ``id``,
    ``type``, ``function`` with ``name`` and ``arguments`` JSON); None without tools. Set after
    generation in the caller's process (the core's wire form does not carry it)."""
    content: str | None = None
    """``LLM.chat(tools=...)``: the text outside the tool calls."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    """Set when the request failed inside the engine (finish_reason ``error``)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one dict per prompt token (None for the first),
    the top-N plus the prompt token itself. Delta outputs carry it once, in the first output."""
