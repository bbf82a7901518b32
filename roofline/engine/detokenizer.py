"""Incremental detokenization of one request's output, with stop strings.

Text is decoded through a sliding window of token ids instead of token by token: ``decode``
of ``window[prefix_offset:]`` minus ``decode`` of ``window[prefix_offset:read_offset]`` is the
text the new tokens add. Decoding relative to the preceding tokens keeps leading spaces right for
SentencePiece-style tokenizers (whose decoders strip the first token's space) and joins the
bytes of multi-byte characters that byte-level BPE splits over several tokens; while the window
ends in U+FFFD (an incomplete character) nothing is emitted and the offsets stay, so a broken
character is never streamed. The window starts on the last few prompt tokens, so the first
output token keeps its leading space. Stop strings are searched in the accumulated text across
token boundaries; while streaming, the longest tail of the text that could still begin a stop
string is held back until the next update (or ``finished=True``), so a stop string is never
partly emitted. Both come from one Aho-Corasick cursor per sequence
(:mod:`roofline.engine.stop_matcher`): the work per update is linear in the new text, not in the
text generated before it or in the stops' number and length. Text is not passed through HF's
``clean_up_tokenization_spaces`` (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from roofline.engine.stop_matcher import StopMatcher, automaton_for
from roofline.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens kept as left context of the first output token."""

REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class DetokenizerDelta(NamedTuple):
    text_delta: str
    """New text to stream (possibly empty)."""
    stop_string: str | None
    """The stop string that ended the text in this update, or None."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, update by update.

    ``tokenizer`` is an HF ``PreTrainedTokenizerFast`` (its Rust ``backend_tokenizer`` is used)
    or a ``tokenizers.Tokenizer``. Once a stop string is found, or after ``finished=True``,
    later updates are ignored and return an empty delta.
    """

    def __init__(
        self, tokenizer: object, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer: _Decoder = backend if backend is not None else tokenizer  # type: ignore[assignment]
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._matcher = StopMatcher(automaton_for(tuple(self._stop))) if self._stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._token_ids: list[int] = []
        # window = trailing prompt tokens + output tokens not yet left behind by prefix_offset
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        """Start of the decoded window (the tokens before it no longer affect new text)."""
        self._read_offset = len(self._window)
        """Tokens before this one have had their text emitted into ``_text``."""
        self._text = ""
        """Decoded output text (complete characters), cut at a stop string once one is found."""
        self._num_emitted_chars = 0
        self._done = False

    @property
    def output_text(self) -> str:
        """All text returned in deltas so far."""
        return self._text[: self._num_emitted_chars]

    @property
    def token_ids(self) -> list[int]:
        """The output token ids received so far."""
        return self._token_ids

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> DetokenizerDelta:
        """Append new output tokens; ``finished=True`` flushes every held-back character."""
        if self._done:
            return DetokenizerDelta("", None)
        self._token_ids.extend(new_token_ids)
        self._window.extend(new_token_ids)
        new_text = self._decode_new(flush=finished)
        self._text += new_text

        stop = None
        if self._matcher is not None:
            match = self._matcher.feed(
                new_text, report=len(self._token_ids) >= max(1, self._min_tokens)
            )
            if match is not None:  # the matcher has seen all of _text: its positions are ours
                stop_string = self._stop[match.stop_index]
                stop = (stop_string, match.end - len(stop_string))
        if stop is not None:
            stop_string, start = stop
            self._text = self._text[: start + len(stop_string) if self._include_stop else start]
            self._done = True
            return DetokenizerDelta(self._emit(len(self._text)), stop_string)
        if finished:
            self._done = True
            return DetokenizerDelta(self._emit(len(self._text)), None)
        held = 0 if self._matcher is None else self._matcher.num_pending_chars
        return DetokenizerDelta(self._emit(len(self._text) - held), None)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, flush: bool) -> str:
        """The text that the tokens after ``read_offset`` add; empty while it ends in an
        incomplete character (unless ``flush``) or adds nothing (e.g. skipped special tokens)."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window[self._prefix_offset :])
        complete = not new_text.endswith(REPLACEMENT_CHAR)
        if len(new_text) <= len(prefix_text) or not (complete or flush):
            return ""
        # Advance: the window now starts where this update's text starts.
        del self._window[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def _emit(self, end: int) -> str:
        end = max(end, self._num_emitted_chars)
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta
