"""The xgrammar backend: JSON schemas, regexes, choices and EBNF grammars compiled against the
tokenizer's vocabulary, matchers that fill a packed int32 bitmask (one bit per token, 32 tokens
per word), and xgrammar's own apply (``apply_bitmask``: the CPU path; on CUDA the engine's
``MaskTable`` masks with ``kernels/token_bitmask.py`` instead, and ``apply_bitmask`` serves
benchmarks). The compiler caches compiled grammars itself; compile calls are thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from torch import Tensor

from roofline.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from roofline.structured_output.params import StructuredOutputsParams


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_threads: int = 2) -> None:
        self.vocab_size = tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self._batches: dict[int, xgr.BatchGrammarMatcher] = {}
        """By thread count: "auto" spawns one thread per host core, which on a many-core GPU
        host cost 3-4 ms per step for fills of a few microseconds a row."""

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> XGrammarBackend:
        """For a Hugging Face tokenizer; ``vocab_size`` is the logits' width (may exceed the
        tokenizer's: padded rows are never allowed)."""
        from roofline.models.light_tokenizer import hf_tokenizer

        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer(tokenizer), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        return cls(info)

    @staticmethod
    def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
        kind = params.kind
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(params.json), any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)

    def validate(self, params: StructuredOutputsParams) -> None:
        try:
            self._grammar(params)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise ValueError(f"{params.field_name}: invalid {params.kind}: {e}") from e

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, compiler = params.kind, self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:
            raise ValueError(f"{params.field_name}: invalid {kind}: {e}") from e

    def matcher(
        self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int = 0
    ) -> XGrammarMatcher:
        return XGrammarMatcher(
            xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2.8
        )

    def allocate_bitmask(self, num_rows: int) -> Tensor:
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # [rows, ceil(V / 32)]
        return bitmask.pin_memory() if torch.cuda.is_available() else bitmask

    def fill_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: Tensor,
        rows: Sequence[int],
        num_threads: int = 1,
    ) -> None:
        batch = self._batches.get(num_threads)
        if batch is None:
            batch = self._batches[num_threads] = xgr.BatchGrammarMatcher(max_threads=num_threads)
        inner = [m._m for m in matchers]  # type: ignore[attr-defined]
        batch.batch_fill_next_token_bitmask(inner, bitmask, list(rows))  # releases the GIL

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
