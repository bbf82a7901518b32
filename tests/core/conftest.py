"""Shared fixtures for the pure-Python scheduler and KV-manager tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from roofline.request import Request
from roofline.sampling_params import SamplingParams

MakeRequest = Callable[..., Request]

_PARAM_FIELDS = ("min_tokens", "stop_token_ids", "ignore_eos", "n")


@pytest.fixture
def make_request() -> MakeRequest:
    """Factory for requests with strictly increasing arrival times (creation order)."""
    clock = itertools.count()

    def make(
        request_id: str, prompt: Sequence[int], max_tokens: int = 16, **kwargs: Any
    ) -> Request:
        params = {k: kwargs.pop(k) for k in _PARAM_FIELDS if k in kwargs}
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, **params),
            max_tokens=max_tokens,
            arrival_time=float(next(clock)),
            **kwargs,
        )

    return make
