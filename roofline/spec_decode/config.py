"""The user's speculative-decoding choice, validated before anything is loaded.

``LLM(..., speculative_config={...})`` and ``--speculative-config '<json>'`` take vLLM's keys:
``method`` (``ngram``, ``draft_model``, or the benchmark-only ``oracle``),
``num_speculative_tokens`` (k), ``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram sizes),
``model`` (the draft), plus roofline's ``disable_by_batch_size`` (speculate only while at most
that many requests run; default from the roofline model) and ``acceptance_rate`` (the oracle's
alpha). Unknown keys, k < 1, k too large for the context, or an unknown method raise
``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "oracle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for the target to verify."""

    method: str
    """``ngram`` (prompt lookup), ``draft_model`` (a smaller model with the same vocabulary)
    or ``oracle`` (benchmarks: the target's own greedy continuation, corrupted)."""
    num_speculative_tokens: int
    """k: tokens proposed per request per step (the step verifies 1 + k)."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched against the request's history."""
    prompt_lookup_min: int = 1
    """Shortest n-gram that counts as a match."""
    model: str | None = None
    """The draft model (HF folder, ``.gguf``, short name or config) for ``draft_model``."""
    disable_by_batch_size: int | None = None
    """Speculate only while at most this many requests run; None: the largest batch at which
    the roofline model predicts a gain (``spec_decode/adaptive.py``)."""
    acceptance_rate: float = 0.7
    """The oracle's per-token acceptance probability alpha (benchmarks only)."""
    seed: int = 0
    """Seed of the oracle's corruption draws."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method draft_model needs 'model' (the draft)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")

    def check_context(self, max_model_len: int) -> None:
        """k must leave room for a prompt token and the bonus token in the context."""
        if self.num_speculative_tokens + 2 > max_model_len:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} is too large for "
                f"max_model_len={max_model_len}"
            )

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)`` (a dict) or the CLI (a JSON string)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
