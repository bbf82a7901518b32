"""First-run CLI behaviour: bad arguments and unusable models fail before any model loads;
several bare words are one prompt; serve refuses a busy port before loading."""

from __future__ import annotations

import socket

import pytest

from roofline.entrypoints import cli


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> list:
    loads: list = []

    def fail(ns):
        loads.append(ns)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "_engine", fail)
    return loads


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-tokens", "-1", "hi"],
        ["generate", "--temperature", "-2", "hi"],
        ["chat", "--top-p", "0"],
        ["generate", "--model", "qwen3-0.6b", "hi"],
        ["generate", "--model", "/no/such/model.gguf", "hi"],
    ],
)
def test_fails_before_loading(argv, no_load, capsys) -> None:
    assert cli.main(argv) == 2
    assert not no_load
    assert "roofline: error:" in capsys.readouterr().err


def test_random_weight_config_is_named_as_such(no_load, capsys) -> None:
    cli.main(["generate", "--model", "qwen3-0.6b", "hi"])
    assert "random-weight config" in capsys.readouterr().err
    sub = cli.build_parser()._subparsers._group_actions[0]
    assert "Random-weight configs for benchmarks" in " ".join(
        sub.choices["generate"].format_help().split()
    )


def test_bare_words_are_one_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []

    class FakeEngine:
        tokenizer = None

    monkeypatch.setattr(cli, "_engine", lambda ns: FakeEngine())
    monkeypatch.setattr(cli, "_stream", lambda eng, rid, prompt, params: seen.append(prompt))
    assert cli.main(["generate", "What", "is", "the", "capital", "of", "France"]) == 0
    assert seen == ["What is the capital of France"]


def test_chat_defaults_end_answers() -> None:
    ns = cli.build_parser().parse_args(["chat"])
    params = cli._sampling_params(ns)
    assert params.max_tokens == 512 and params.repetition_penalty == 1.1


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("roofline ")


def test_serve_checks_port_before_loading(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    pytest.importorskip("fastapi")
    from roofline.engine import async_engine

    def fail(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(async_engine.AsyncLLMEngine, "from_engine_args", fail)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
