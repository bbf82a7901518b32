"""The seam between roofline and a grammar library: what a structured-output backend provides.

A backend turns :class:`StructuredOutputsParams` into a compiled grammar for one tokenizer,
makes per-sequence :class:`GrammarMatcher`\\ s from it, and owns the token bitmask's layout
(how it is allocated on the host, filled by a matcher, and applied to logits on the device).
xgrammar is the default (:mod:`roofline.structured_output.xgrammar_backend`), llguidance the
optional second (:mod:`roofline.structured_output.llguidance_backend`); :func:`make_backend`
picks one by name. Nothing outside this package imports a grammar library.

Matchers are what speculative decoding checks proposals against: ``accept_token`` advances on
one token (False, state unchanged, if the grammar forbids it), ``rollback(k)`` undoes the last
``k`` accepted tokens (up to the ``max_rollback_tokens`` the matcher was made with), and
:meth:`GrammarMatcher.count_valid_prefix` accepts a proposal's longest valid prefix and rolls it
back again, returning its length: the verifier may accept at most that many draft tokens.
"""

from __future__ import annotations

import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from roofline.structured_output.params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance on ``token_id``; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of a host bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted a stop token (nothing more may follow)."""

    def count_valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a proposal the grammar allows; the state is unchanged
        afterwards (needs ``max_rollback_tokens >= len(token_ids)``)."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self.rollback(accepted)
        return accepted


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary size."""

    name: str

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Refuse a constraint the library cannot parse (bad regex, unsupported schema) with a
        ``ValueError``, without compiling it against the vocabulary (cheap)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (opaque; thread-safe, cached by the constraint's key)."""

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback_tokens: int = 0) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Tensor:
        """A host bitmask for ``num_rows`` rows (every token allowed)."""

    def fill_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: Tensor,
        rows: Sequence[int],
        num_threads: int = 1,
    ) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` from ``matchers[i]`` (on up to ``num_threads``
        threads, where the library has them; called off the main thread, so it must not need
        the GIL for long)."""
        for row, matcher in zip(rows, matchers):
            matcher.fill_bitmask(bitmask, row)

    @abstractmethod
    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> None:
        """Set the disallowed logits of every row to -inf, in place (``bitmask`` on the logits'
        device, one row per logits row)."""


BACKENDS = ("auto", "xgrammar", "llguidance")


def resolve_backend_name(name: str, config: dict | str | None = None) -> str:
    """The backend asked for by ``--structured-outputs-backend`` or vLLM's
    ``structured_outputs_config`` (``{"backend": ...}``, a dict or its JSON); ``ValueError`` for
    an unknown name, another key, or llguidance when it is not installed."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from e
    if config is not None:
        if not isinstance(config, dict) or set(config) - {"backend"}:
            raise ValueError('structured_outputs_config must be {"backend": <name>}')
        name = config.get("backend", name)
    if name not in BACKENDS:
        raise ValueError(f"structured outputs backend must be one of {BACKENDS}, got {name!r}")
    if name == "llguidance" and importlib.util.find_spec("llguidance") is None:
        raise ValueError("the llguidance backend needs llguidance: pip install llguidance")
    return name


def make_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> StructuredOutputBackend:
    """The backend called ``name`` for this tokenizer ("auto" and "xgrammar": xgrammar;
    "llguidance" when installed)."""
    if name in ("auto", "xgrammar"):
        from roofline.structured_output.xgrammar_backend import XGrammarBackend

        return XGrammarBackend.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        try:
            from roofline.structured_output.llguidance_backend import LLGuidanceBackend
        except ImportError as e:
            raise ValueError(
                "the llguidance backend needs llguidance: pip install 'roofline[llguidance]'"
            ) from e
        return LLGuidanceBackend.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(
        f"structured output backend must be auto, xgrammar or llguidance, got {name!r}"
    )
