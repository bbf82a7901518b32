"""IncrementalDetokenizer on tiny tokenizers trained here: a byte-level BPE (multi-byte
characters split over several tokens), a raw byte tokenizer (one token per byte) and a
SentencePiece-style BPE with byte fallback and a space-stripping decoder."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from roofline.engine.detokenizer import IncrementalDetokenizer
from roofline.sampling_params import SamplingParams

CORPUS = [
    "the cat sat on the mat. héllo wörld, café naïve résumé",
    "日本語のテキスト 日本 東京 こんにちは世界",
    "emoji 🎉 party 🎉🎉 rocket 🚀 thumbs 👍🏽 done",
    "stop here please; the end is near. hello world!",
]
TEXTS = [
    "the cat sat on 日本 🎉 café",
    "héllo wörld 🚀 東京 こんにちは",
    " naïve résumé 👍🏽 the end",
    "日本語🎉🎉x",
]


def _byte_level_bpe(vocab_size: int | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if vocab_size is None:  # no merges: every byte is one token
        trainer = trainers.BpeTrainer(
            vocab_size=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator([], trainer)
        tok.add_special_tokens(["<eos>"])
    else:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<eos>"],
            show_progress=False,
        )
        tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return _byte_level_bpe(vocab_size=330)


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return _byte_level_bpe(vocab_size=None)


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """Llama-2-like: '▁' marks spaces, unknown characters fall back to <0xNN> byte tokens, and
    the decoder strips the first space of the decoded text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<s>", "</s>"], limit_alphabet=30, show_progress=False
    )
    tok.train_from_iterator(["the cat sat on the mat, hello world. a big dog ran"] * 10, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


def _stream(
    tok: object,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    rng: random.Random | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``output`` in chunks (one token each, or random sizes); the last update finishes."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    i = 0
    while i < len(output):
        n = rng.randint(1, 3) if rng else 1
        deltas.append(detok.update(output[i : i + n], finished=i + n >= len(output)).text_delta)
        i += n
    return deltas, detok


def test_tokenizers_split_multibyte_characters(bpe: Tokenizer, byte_tok: Tokenizer) -> None:
    # The premise of the tests below: single tokens decode to broken characters.
    for tok in (bpe, byte_tok):
        ids = tok.encode("日本🎉").ids
        assert any("\ufffd" in tok.decode([t]) for t in ids)


@pytest.mark.parametrize("chunked", [False, True])
def test_valid_text_round_trips_without_broken_chars(
    bpe: Tokenizer, byte_tok: Tokenizer, chunked: bool
) -> None:
    rng = random.Random(1)
    for tok in (bpe, byte_tok):
        prompt = tok.encode("hello ").ids
        for _ in range(40):
            text = "".join(rng.choice(TEXTS + [" ", "é", "🎉"]) for _ in range(rng.randint(1, 6)))
            output = tok.encode(text).ids
            deltas, detok = _stream(tok, prompt, output, SamplingParams(), rng if chunked else None)
            assert "".join(deltas) == text == tok.decode(output)
            assert all("\ufffd" not in d for d in deltas)
            assert detok.output_text == text
            assert detok.token_ids == output


def test_random_tokens_concatenate_to_full_decode(bpe: Tokenizer) -> None:
    # Arbitrary ids (broken bytes, specials anywhere): the stream still equals decode(all).
    rng = random.Random(2)
    vocab_size = bpe.get_vocab_size()
    prompt = bpe.encode("the cat").ids
    for _ in range(300):
        output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 25))]
        skip = rng.random() < 0.5
        params = SamplingParams(skip_special_tokens=skip)
        deltas, _ = _stream(bpe, prompt, output, params, rng)
        assert "".join(deltas) == bpe.decode(output, skip_special_tokens=skip)


def test_broken_character_held_until_complete(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a🎉").ids  # 'a' + 4 bytes
    assert len(ids) == 5
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("x").ids, SamplingParams())
    assert detok.update(ids[:1]).text_delta == "a"
    for t in ids[1:4]:
        assert detok.update([t]).text_delta == ""
    assert detok.update(ids[4:]).text_delta == "🎉"


def test_unfinished_character_flushed_on_finish(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("日").ids
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("x").ids, SamplingParams())
    assert detok.update(ids[:1]).text_delta == ""
    assert detok.update(ids[1:2], finished=True).text_delta == byte_tok.decode(ids[:2])


def test_sentencepiece_leading_spaces(sp_tok: Tokenizer) -> None:
    prompt = sp_tok.encode("the cat").ids
    text = "sat on the mat 日本 hello 🎉 world"
    output = sp_tok.encode(text).ids  # '▁sat', ... : every word's space is inside its token
    assert any(sp_tok.id_to_token(t).startswith("<0x") for t in output)
    # Token by token the spaces vanish; relative to the preceding tokens they stay.
    assert "".join(sp_tok.decode([t]) for t in output) != " " + text
    deltas, _ = _stream(sp_tok, prompt, output, SamplingParams())
    assert "".join(deltas) == " " + text
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_skipped_special_token_keeps_next_space(sp_tok: Tokenizer) -> None:
    # A token that decodes to nothing must not become the start of the decoded window, or the
    # decoder would strip the next word's space.
    eos = sp_tok.token_to_id("</s>")
    output = sp_tok.encode("sat").ids + [eos] + sp_tok.encode("on the").ids
    deltas, _ = _stream(sp_tok, sp_tok.encode("the cat").ids, output, SamplingParams())
    assert "".join(deltas) == " sat on the"
    # A prompt of only special tokens: like decode(prompt + output), the first space goes.
    deltas, _ = _stream(sp_tok, [eos], output[1:], SamplingParams())
    assert "".join(deltas) == "on the" == sp_tok.decode([eos] + output[1:])


def test_sentencepiece_random_sequences(sp_tok: Tokenizer) -> None:
    rng = random.Random(3)
    words = [t for t, i in sp_tok.get_vocab().items() if not t.startswith("<")]
    words = [sp_tok.token_to_id(w) for w in words]
    for _ in range(200):
        prompt = sp_tok.encode(rng.choice(["the cat", "hello", "a big dog"])).ids
        output: list[int] = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.3:
                output += sp_tok.encode(rng.choice(["日本", "🎉", "é x"])).ids
            else:
                output.append(rng.choice(words))
        deltas, _ = _stream(sp_tok, prompt, output, SamplingParams(), rng)
        full = sp_tok.decode(prompt + output)
        assert "".join(deltas) == full[len(sp_tok.decode(prompt)) :]


def test_hf_fast_tokenizer_wrapper(bpe: Tokenizer) -> None:
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    text = "日本 café 🎉"
    output = bpe.encode(text).ids + [bpe.token_to_id("<eos>")]
    deltas, _ = _stream(hf, hf.encode("the"), output, SamplingParams())
    assert "".join(deltas) == text
    deltas, _ = _stream(hf, hf.encode("the"), output, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == text + "<eos>"


def test_window_stays_bounded(bpe: Tokenizer) -> None:
    output = bpe.encode("the cat sat on the mat. 日本 🎉 " * 40).ids
    detok = IncrementalDetokenizer(bpe, [1, 2, 3], SamplingParams())
    for t in output:
        detok.update([t])
        assert len(detok._window) <= 6  # the decoded window never grows with the output


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def test_stop_string_across_tokens_is_never_partly_emitted(bpe: Tokenizer) -> None:
    text = "hello world, the cat sat on the mat. 日本 café"
    stop = "cat sat"
    output = bpe.encode(text).ids
    assert not any(stop in bpe.decode([t]) for t in output)  # the stop spans tokens
    expected = text[: text.index(stop)]
    detok = IncrementalDetokenizer(bpe, [1], SamplingParams(stop=["zzz", stop]))
    stop_string = None
    for t in output:
        delta = detok.update([t])
        assert expected.startswith(detok.output_text)
        if delta.stop_string is not None:
            stop_string = delta.stop_string
            break
    assert stop_string == stop
    assert detok.output_text == expected
    assert detok.update(output[-2:]) == ("", None)  # updates after the stop are ignored


def test_stop_string_multibyte(byte_tok: Tokenizer) -> None:
    output = _byte_ids(byte_tok, "ab日本cd")
    deltas, detok = _stream(byte_tok, [1], output, SamplingParams(stop=["本c"]))
    assert "".join(deltas) == detok.output_text == "ab日"


def test_stop_string_at_start(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [1], SamplingParams(stop=["ab"]))
    assert detok.update(_byte_ids(byte_tok, "a")) == ("", None)
    assert detok.update(_byte_ids(byte_tok, "bc")) == ("", "ab")
    assert detok.output_text == ""


def test_include_stop_str_in_output(byte_tok: Tokenizer) -> None:
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    deltas, detok = _stream(byte_tok, [1], _byte_ids(byte_tok, "abcENDxyz"), params)
    assert "".join(deltas) == detok.output_text == "abcEND"


def test_first_ending_stop_string_wins(byte_tok: Tokenizer) -> None:
    # The text stops where a stop string first ends, however the tokens arrive (one update or
    # one token per update); of two ending there, the longer (it starts first).
    for stops, expected in ((["cd", "bcde"], ("ab", "cd")), (["cd", "bcd"], ("a", "bcd"))):
        params = SamplingParams(stop=stops)
        detok = IncrementalDetokenizer(byte_tok, [1], params)
        assert detok.update(_byte_ids(byte_tok, "abcdef")) == expected
        deltas, _ = _stream(byte_tok, [1], _byte_ids(byte_tok, "abcdef"), params)
        assert "".join(deltas) == expected[0]


def test_holdback_of_possible_stop_prefix(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [1], SamplingParams(stop=["xyz", "\n\n"]))
    assert detok.update(_byte_ids(byte_tok, "abc")).text_delta == "abc"  # nothing to hold
    assert detok.update(_byte_ids(byte_tok, "x")).text_delta == ""
    assert detok.update(_byte_ids(byte_tok, "y")).text_delta == ""
    assert detok.update(_byte_ids(byte_tok, "q")).text_delta == "xyq"  # not a stop after all
    assert detok.update(_byte_ids(byte_tok, "\n")).text_delta == ""
    assert detok.update(_byte_ids(byte_tok, "x"), finished=True) == ("\nx", None)
    assert detok.output_text == "abcxyq\nx"


def test_min_tokens_delays_stop_strings(byte_tok: Tokenizer) -> None:
    params = SamplingParams(stop=["a"], min_tokens=3)
    deltas, detok = _stream(byte_tok, [1], _byte_ids(byte_tok, "bababa"), params)
    assert detok.output_text == "bab"


def test_no_stop_strings_streams_everything(byte_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [1], SamplingParams())
    assert detok.update(_byte_ids(byte_tok, "xy")).text_delta == "xy"
    assert detok.update([], finished=True) == ("", None)
