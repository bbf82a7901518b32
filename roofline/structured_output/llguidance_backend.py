"""The llguidance backend (optional: ``pip install roofline[llguidance]``): JSON schemas, regexes,
choices (as a Lark grammar) and GBNF grammars (converted to Lark) through llguidance's
Earley-based matcher, which computes each mask on the fly (no per-vocabulary precompile, so a
new schema is usable at once). The bitmask layout is xgrammar's (int32 words, bit ``t % 32`` of
word ``t // 32``), so the mask table, its upload and the fused kernel are shared.

llguidance's matcher enters an error state on a forbidden token; :meth:`accept_token` tries the
token first, so a refused token leaves the state unchanged as the interface requires. The
matcher counts as terminated once it has consumed a stop token (``is_stopped`` alone also holds
while only a stop token may follow, when the row must still be masked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from torch import Tensor

from roofline.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from roofline.structured_output.params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON, as the xgrammar backend (``any_whitespace=False``)."""


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop = stop_token_ids
        self._stopped_at: int | None = None
        """How many tokens had been consumed when a stop token was (rollback clears it)."""
        self._num_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        if self._stopped_at is not None:
            return False
        if token_id in self._stop:  # llguidance's try/validate calls never take a stop token
            if not self._m.is_accepting() or not self._m.consume_token(token_id):
                return False
            self._num_tokens += 1
            self._stopped_at = self._num_tokens
            return True
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._num_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._num_tokens -= num_tokens
            if self._stopped_at is not None and self._stopped_at > self._num_tokens:
                self._stopped_at = None

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._stopped_at is not None

    def count_valid_prefix(self, token_ids: Sequence[int]) -> int:
        if self._stopped_at is not None:
            return 0
        valid = self._m.validate_tokens(list(token_ids))
        if valid < len(token_ids) and token_ids[valid] in self._stop:  # a stop token may end it
            if valid:
                self._m.consume_tokens(list(token_ids[:valid]))
            accepting = self._m.is_accepting()
            if valid:
                self._m.rollback(valid)
            valid += accepting
        return valid


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop = frozenset(tokenizer.eos_tokens)
        self._executors: dict[int, llguidance.LLExecutor] = {}

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> LLGuidanceBackend:
        from roofline.models.light_tokenizer import hf_tokenizer

        stops = list(stop_token_ids) or None
        info = llguidance.hf.from_tokenizer(
            hf_tokenizer(tokenizer), n_vocab=vocab_size, eos_token=stops
        )
        return cls(info, vocab_size)

    @staticmethod
    def _grammar(params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(_lark_string(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(params.grammar))

    def validate(self, params: StructuredOutputsParams) -> None:
        self.compile(params)

    def compile(self, params: StructuredOutputsParams) -> str:
        try:
            grammar = self._grammar(params)
            error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        except Exception as e:  # the converters raise ValueError / RuntimeError
            raise ValueError(f"{params.field_name}: invalid {params.kind}: {e}") from e
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{params.field_name}: invalid {params.kind}: {error}")
        return grammar

    def matcher(self, compiled: str, max_rollback_tokens: int = 0) -> LLGuidanceMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return LLGuidanceMatcher(matcher, self._stop)

    def allocate_bitmask(self, num_rows: int) -> Tensor:
        return llguidance.torch.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: Tensor,
        rows: Sequence[int],
        num_threads: int = 1,
    ) -> None:
        if num_threads <= 1:
            super().fill_rows(matchers, bitmask, rows)
            return
        executor = self._executors.get(num_threads)
        if executor is None:
            executor = self._executors[num_threads] = llguidance.LLExecutor(num_threads)
        pairs = [(m._m, row) for m, row in zip(matchers, rows)]  # type: ignore[attr-defined]
        llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask)

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> None:
        # The layout is xgrammar's, and xgrammar (a core dependency) has a C++ CPU kernel for
        # it; llguidance's own torch.compile'd one would compile on first use. (On the GPU the
        # mask table's fused kernel is used, not this.)
        import xgrammar as xgr

        rows = logits.shape[0]
        xgr.apply_token_bitmask_inplace(logits, bitmask[:rows], vocab_size=self.vocab_size)
