"""The proposer interface: strategy objects that guess each running request's next tokens.

``SpecDecoder`` asks its proposer, once per step before scheduling, for up to ``max_lens[i]``
tokens per request (the per-request k: the configured k clipped so that ``max_tokens`` and
``max_model_len`` are never passed). A proposer returns token lists and keeps whatever per-request
state it needs until ``remove``. Proposals are one-hot guesses (q is a point mass), which the
verifier handles exactly; a proposer that samples from its own distribution returns it in
``Proposals.draft_probs``.

The seam for EAGLE / MTP heads: a proposer whose ``needs_hidden_states`` is True receives the
target's last-layer hidden states of each request's last verified position in
``propose(..., hidden_states=...)`` (tokens out, hidden states in); nothing in the scheduler or
the verifier changes. The runner would keep those rows of the step it already computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from roofline.request import Request


@dataclass
class Proposals:
    token_ids: list[list[int]]
    """Per request, its proposals (possibly empty: that request verifies nothing)."""
    draft_probs: list[Tensor | None] | None = None
    """Per request, [k_i, V] distribution each proposal was drawn from (None: one-hot)."""


class Proposer(Protocol):
    needs_hidden_states: bool
    shadows: bool
    """Proposing costs only host time and changes no state, so the adaptive switch may ask for
    proposals no step verifies while speculation is off (n-gram: True; a draft model: False)."""

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals: ...

    def remove(self, request_ids: Iterable[str]) -> None: ...
