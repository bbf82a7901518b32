"""Per-request sampling parameters, validated when constructed.

Names and defaults follow vLLM's ``SamplingParams`` so code moves over unchanged. Every
invalid value raises ``ValueError`` naming the field and the allowed range; NaN and infinities
are refused everywhere a float is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from roofline.structured_output.params import StructuredOutputsParams

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
"""Longest stop string (characters); with ``MAX_STOP_STRINGS`` it bounds a stop list's
automaton (``engine/stop_matcher.py``) to 32,768 trie nodes."""
MAX_LOGPROBS = 20
MAX_N = 128


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def _int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions per prompt (they share the prompt's KV pages)."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    presence_penalty: float = 0.0
    """OpenAI-style, in [-2, 2], over generated tokens."""
    frequency_penalty: float = 0.0
    """OpenAI-style, in [-2, 2], over generated tokens."""
    repetition_penalty: float = 1.0
    """HF/CTRL-style, > 0, over prompt and generated tokens; 1 disables."""
    max_tokens: int | None = 16
    """New tokens at most; None means up to the model's length."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens are generated."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the text stops before them and they are not emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (emitted as tokens, not as text)."""
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens alone or inside any batch."""
    logprobs: int | None = None
    """Return this many top log-probabilities per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Return this many top log-probabilities per prompt token (plus the prompt token's own);
    such a request recomputes its whole prompt instead of reading the prefix cache."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (vLLM's name)."""

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1, MAX_N)
        self.temperature = _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise ValueError("stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        too_long = [len(s) for s in self.stop if len(s) > MAX_STOP_STRING_CHARS]
        if too_long:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, "
                f"got one of {too_long[0]}"
            )
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = [_int("stop_token_ids[]", t, 0) for t in self.stop_token_ids]
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, -(2**63), 2**64 - 1)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
