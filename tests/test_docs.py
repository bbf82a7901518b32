"""The documents stay true to the tree: every file, ``ROOFLINE_*`` switch and section link that
``docs/architecture.md`` and ``README.md`` name exists (a renamed or removed file, a dropped
switch or a retitled section fails here instead of leaving the map stale)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/architecture.md", "README.md")
SOURCE_SUFFIXES = (".py", ".c", ".inc")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


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
def test_named_switches_are_read(doc: str):
    code = "\n".join(p.read_text() for p in (ROOT / "roofline").rglob("*.py"))
    read = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", code))
    named = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", (ROOT / doc).read_text()))
    assert named <= read, f"{doc} names switches no code reads: {sorted(named - read)}"


def test_section_links_resolve():
    text = (ROOT / "docs/architecture.md").read_text()
    anchors = {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "the map at the top links to the sections"
    broken = sorted(set(links) - anchors)
    assert not broken, f"links to no heading: {broken}"


def test_every_switch_the_code_reads_is_documented():
    """A new ``ROOFLINE_*`` environment switch gets its row in the architecture document's
    Environment switches table (name, default, what it changes) in the change that adds it."""
    code = "\n".join(p.read_text() for p in (ROOT / "roofline").rglob("*.py"))
    read = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", code))
    named = set(re.findall(r"ROOFLINE_[A-Z0-9_]+", (ROOT / "docs/architecture.md").read_text()))
    assert read <= named, f"switches docs/architecture.md does not list: {sorted(read - named)}"
