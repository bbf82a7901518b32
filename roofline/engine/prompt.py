"""Prompt tokenization shared by the offline engine and the API process (no torch import)."""

from __future__ import annotations

from typing import Any


def tokenize_prompt(tokenizer: Any, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """``(text, token_ids)`` for a string prompt (tokenized) or a list of token ids (checked)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): pass token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        if not prompt.isascii():
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # the tokenizer would raise a TypeError
                raise ValueError(
                    f"the prompt is not valid Unicode (a lone surrogate at character {e.start})"
                ) from None
        return prompt, list(tokenizer(prompt).input_ids)
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise ValueError("a prompt must be a string or a list of token ids (ints)")
    return None, list(prompt)
