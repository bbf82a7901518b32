"""The documents stay true to the tree: every file, ``roofline/...`` path, ``ROOFLINE_*`` switch,
code name, relative link, section anchor and example command line that ``docs/architecture.md``,
``docs/planner.md`` and ``README.md`` show exists (a renamed or removed file, a dropped switch or
flag, a retitled section fails here instead of leaving the document stale)."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/architecture.md", "docs/planner.md", "README.md")
SOURCE_SUFFIXES = (".py", ".c", ".inc")
TREE_TOPS = ("roofline", "scripts", "tests", "docs", ".ci")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _prose_and_fences(text: str) -> tuple[list[str], list[str]]:
    """(lines outside fenced code blocks, lines inside them)."""
    prose: list[str] = []
    fenced: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        (fenced if inside else prose).append(line)
    return prose, fenced


def _tree_files() -> list[str]:
    return [
        p.relative_to(ROOT).as_posix()
        for top in ("roofline", "scripts", "tests")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES
    ]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-``/``_`` dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose, _ = _prose_and_fences(path.read_text())
    return {_anchor(line.lstrip("#")) for line in prose if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS)
def test_named_source_files_exist(doc: str):
    files = _tree_files()
    names = {f.rsplit("/", 1)[-1] for f in files}
    missing = []
    for span in _code_spans((ROOT / doc).read_text()):
        if not re.fullmatch(r"[\w./-]+", span) or not span.endswith(SOURCE_SUFFIXES):
            continue
        if "/" in span:  # relative to the root, to roofline/, or to a package the text names
            ok = any(f == span or f.endswith("/" + span) for f in files)
        else:
            ok = span in names
        if not ok:
            missing.append(span)
    assert not missing, f"{doc} names files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS)
def test_named_tree_paths_exist(doc: str):
    """``roofline/planner/``, ``scripts/gpu_x.py``, ``docs/planner.md``: files or folders."""
    tops = "|".join(re.escape(t) for t in TREE_TOPS)
    paths = [
        s for s in _code_spans((ROOT / doc).read_text()) if re.fullmatch(rf"(?:{tops})/[\w./-]*", s)
    ]
    missing = sorted({p for p in paths if not (ROOT / p.rstrip("/")).exists()})
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_named_switches_are_read(doc: str):
    code = "\n".join(p.read_text() for p in (ROOT / "roofline").rglob("*.py"))
    read = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", code))
    named = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", (ROOT / doc).read_text()))
    assert named <= read, f"{doc} names switches no code reads: {sorted(named - read)}"


@functools.cache
def _code_words() -> frozenset[str]:
    return frozenset(
        w
        for p in (ROOT / "roofline").rglob("*")
        if p.suffix in SOURCE_SUFFIXES
        for w in re.findall(r"\w+", p.read_text())
    )


@pytest.mark.parametrize("doc", DOCS)
def test_named_code_names_exist(doc: str):
    """Names written as code (``module.name``, ``CamelCase``, ``name()``) occur in the code:
    a renamed function or class does not live on in the text. Bare ``snake_case`` spans are
    left alone (formulas use them for quantities)."""
    words = _code_words()
    missing = []
    for span in _code_spans((ROOT / doc).read_text()):
        if not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?", span):
            continue
        if re.search(r"\.(?:py|md|json|c|inc|txt|toml|png|gguf|sh|jsonl)$", span):
            continue  # a file name (the file checks above)
        if not (span.endswith("()") or "." in span or re.search(r"[a-z][A-Z]", span)):
            continue
        if not all(w in words for w in re.findall(r"\w+", span.removesuffix("()"))):
            missing.append(span)
    assert not missing, f"{doc} names code the tree lacks: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc: str):
    """Relative links reach a file, and their ``#anchor`` (same document or another) a
    heading of it."""
    path = ROOT / doc
    prose, _ = _prose_and_fences(path.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", "\n".join(prose)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{doc} links to nothing: {sorted(set(broken))}"


def test_architecture_map_links_the_sections():
    text = (ROOT / "docs/architecture.md").read_text()
    assert re.findall(r"\]\(#([^)]+)\)", text), "the map at the top links to the sections"


@functools.cache
def _parser(command: str):
    from roofline.entrypoints.cli import build_parser

    return build_parser(command)


@pytest.mark.parametrize("doc", DOCS)
def test_example_command_lines_parse(doc: str):
    """Every ``roofline ...`` line of a fenced example block parses: its sub-commands and flags
    exist and take the values shown (nothing is run). Indented lines are printed output."""
    _, fenced = _prose_and_fences((ROOT / doc).read_text())
    failed = []
    for line in fenced:
        line = line.removeprefix("$ ").rstrip()
        if not line.startswith("roofline "):
            continue
        argv = shlex.split(line)[1:]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                _parser(argv[0]).parse_args(argv)
        except SystemExit:
            failed.append(f"{line}: {err.getvalue().strip().splitlines()[-1:]}")
    assert not failed, f"{doc} shows command lines that do not parse: {failed}"


def test_every_switch_the_code_reads_is_documented():
    """A new ``ROOFLINE_*`` environment switch gets its row in the architecture document's
    Environment switches table (name, default, what it changes) in the change that adds it."""
    code = "\n".join(p.read_text() for p in (ROOT / "roofline").rglob("*.py"))
    read = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", code))
    named = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", (ROOT / "docs/architecture.md").read_text()))
    assert read <= named, f"switches docs/architecture.md does not list: {sorted(read - named)}"


def test_planner_examples_print_what_the_document_shows(capsys, monkeypatch, tmp_path):
    """Each indented line under a ``roofline plan ...`` example of ``docs/planner.md`` is a line
    that command prints (spaces collapsed; a trailing ``...`` matches the rest of the line):
    the figures quoted there come from the code as it is."""
    from roofline.entrypoints.cli import main

    monkeypatch.chdir(tmp_path)  # anything an example writes lands here
    examples: list[tuple[str, list[str]]] = []
    shown: list[str] | None = None  # the output lines of the example being read
    for line in (ROOT / "docs/planner.md").read_text().splitlines():
        if line.lstrip().startswith("```"):
            shown = None  # a fence ends (or starts) every example
        elif line.startswith("roofline "):
            shown = []
            examples.append((line, shown))
        elif line.startswith("  ") and shown is not None:
            shown.append(" ".join(line.split()))
    checked = 0
    for command, shown in examples:
        if not shown:
            continue
        assert main(shlex.split(command)[1:]) == 0, command
        printed = [" ".join(out.split()) for out in capsys.readouterr().out.splitlines()]
        for want in shown:
            prefix = want.removesuffix("...").rstrip()
            ok = any(p == want or (want.endswith("...") and p.startswith(prefix)) for p in printed)
            assert ok, f"`{command}` does not print: {want!r}"
        checked += 1
    assert checked >= 5, "the examples show their output"
