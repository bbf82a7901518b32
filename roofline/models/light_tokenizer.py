"""A tokenizer that starts without importing transformers (~0.7 s of imports plus ~0.9 s of
``AutoTokenizer`` set-up on the 2-core dev machine), for the GGUF path's on-disk tokenizer cache.

:class:`LightTokenizer` wraps a ``tokenizers.Tokenizer`` read from a folder that
``save_pretrained`` wrote (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``)
and serves what a request needs on its own: encoding (``tok(text).input_ids``, ``encode``),
decoding (also through ``backend_tokenizer``, as the incremental detokenizer reads it), the
special tokens, and chat templates for plain ``{"role", "content"}`` string messages, rendered in
a sandboxed jinja2 environment set up as transformers sets its own (trim/lstrip blocks, loop
controls, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``). Everything else (tools,
documents, structured outputs' vocabulary export, any other attribute) goes to the HF tokenizer
loaded from the same folder on first use, so behaviour never depends on which one served it;
``tests/models/test_light_tokenizer.py`` checks both agree.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Encoding(NamedTuple):
    input_ids: list[int]


class LightTokenizer:
    """See the module docstring; ``hf`` is the full HF tokenizer (loaded on first access)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.backend_tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        config_path = self.folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = self.folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.is_file() else config.get("chat_template")
        )
        self._special = {n: _token_text(config.get(n)) for n in SPECIAL_NAMES}
        self._hf: Any = None
        self._compiled: tuple[str, Any] | None = None

    # ------------------------------------------------------------------ special tokens
    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def unk_token(self) -> str | None:
        return self._special["unk_token"]

    @property
    def pad_token(self) -> str | None:
        return self._special["pad_token"]

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        return Encoding(self.encode(text, add_special_tokens))

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        conversation: Any,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        template = self.chat_template
        plain = (
            not kwargs
            and not tokenize  # HF returns a dict of ids then; that form is left to it
            and template is not None
            and isinstance(conversation, list)
            and all(_plain_message(m) for m in conversation)
        )
        if not plain:
            return self.hf.apply_chat_template(
                conversation,
                tokenize=tokenize,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        assert template is not None
        text = self._template(template).render(
            messages=[dict(m) for m in conversation],
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self._special.items() if v is not None},
        )
        return text

    def _template(self, source: str) -> Any:
        if self._compiled is None or self._compiled[0] != source:
            self._compiled = (source, _environment().from_string(source))
        return self._compiled[1]

    # ------------------------------------------------------------------ the HF fallback
    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same folder (imports transformers once)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.folder))
        return self._hf

    def __getstate__(self) -> dict[str, Any]:  # picklable: compiled template and HF dropped
        return {**self.__dict__, "_hf": None, "_compiled": None}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (itself when it is one), for libraries
    that check its type (xgrammar's vocabulary export)."""
    return tokenizer.hf if isinstance(tokenizer, LightTokenizer) else tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken saved as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and set(message) == {"role", "content"}
        and isinstance(message["role"], str)
        and isinstance(message["content"], str)
    )


def _environment() -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
