"""Request length distributions and synthetic serving workloads.

A :class:`LengthDist` is parsed from a short spec (``512``, ``fixed:512``, ``uniform:128:1024``,
``normal:512:128``, ``lognormal:512:256`` as mean and standard deviation, ``exp:256``) and
sampled with a seeded ``random.Random`` so every workload is reproducible. A
:class:`Workload` adds Poisson arrivals (or all requests at time zero for an offline run) and an
optional shared prompt prefix that exercises the prefix cache.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0
    min_len: int = 1
    max_len: int | None = None

    @classmethod
    def parse(cls, spec: str | int, max_len: int | None = None) -> LengthDist:
        if isinstance(spec, int):
            return cls("fixed", float(spec), max_len=max_len)
        parts = spec.strip().split(":")
        try:
            nums = [float(p) for p in parts[1:]] if len(parts) > 1 else [float(parts[0])]
        except ValueError as e:
            raise ValueError(f"bad length distribution {spec!r}") from e
        kind = parts[0].lower() if len(parts) > 1 else "fixed"
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
        if kind not in arity or len(nums) != arity[kind]:
            raise ValueError(
                f"bad length distribution {spec!r}: use N, fixed:N, uniform:LO:HI, "
                "normal:MEAN:STD, lognormal:MEAN:STD or exp:MEAN"
            )
        if nums[0] <= 0 or any(n < 0 for n in nums):
            raise ValueError(f"lengths must be positive in {spec!r}")
        if kind == "uniform" and nums[1] < nums[0]:
            raise ValueError(f"uniform needs LO <= HI in {spec!r}")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0, max_len=max_len)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "lognormal":
            sigma2 = math.log(1.0 + (self.b / self.a) ** 2)
            x = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        else:
            x = rng.expovariate(1.0 / self.a)
        n = max(self.min_len, int(round(x)))
        return n if self.max_len is None else min(n, self.max_len)

    def samples(self, n: int, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    @property
    def mean(self) -> float:
        """Mean before clipping to ``[min_len, max_len]``."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def __str__(self) -> str:
        if self.kind in ("fixed", "exp"):
            return f"{self.kind}:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class SyntheticRequest:
    arrival_time_s: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    request_rate: float | None = None
    """Poisson arrivals per second; None = every request arrives at time zero (offline)."""
    prefix_len: int = 0
    """Tokens of a prompt prefix shared by a ``prefix_fraction`` of the requests."""
    prefix_fraction: float = 0.0
    vocab_size: int = 32000
    max_model_len: int | None = None
    """Clip prompts to ``max_model_len - 1`` and outputs so prompt + output fit it."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests <= 0:
            raise ValueError("num_requests must be positive")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be positive (or None for offline)")
        if not 0.0 <= self.prefix_fraction <= 1.0:
            raise ValueError("prefix_fraction must be in [0, 1]")

    def requests(self) -> list[SyntheticRequest]:
        """Deterministic requests in arrival order; token ids avoid 0..9 (special tokens)."""
        rng = random.Random(self.seed)
        token_rng = np.random.default_rng(self.seed)
        prefix = token_rng.integers(10, self.vocab_size, self.prefix_len).tolist()
        t = 0.0
        out = []
        for _ in range(self.num_requests):
            if self.request_rate is not None:
                t += rng.expovariate(self.request_rate)
            n_prompt = self.prompt_len.sample(rng)
            n_out = self.output_len.sample(rng)
            if self.max_model_len is not None:
                n_prompt = min(n_prompt, self.max_model_len - 1)
                n_out = min(n_out, self.max_model_len - n_prompt)
            shared = prefix if prefix and rng.random() < self.prefix_fraction else []
            own = token_rng.integers(10, self.vocab_size, max(1, n_prompt - len(shared))).tolist()
            out.append(SyntheticRequest(t, (shared + own)[:n_prompt], n_out))
        return out
