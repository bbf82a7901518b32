"""The on-disk GGUF index cache: reused while the file is unchanged, rebuilt when it changes;
a file that is not GGUF is named in the error."""

from __future__ import annotations

import os

import pytest

from roofline.models import gguf_index as gi


def test_cache_reused_and_invalidated(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOFLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ROOFLINE_NO_CACHE", raising=False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    calls = []

    def fake_parse(p):
        calls.append(p)
        return {"arch": "llama", "config": {"n": len(calls)}, "chat_template": None, "tensors": []}

    monkeypatch.setattr(gi, "_parse", fake_parse)
    gi._index.cache_clear()
    assert gi.gguf_index(path).config == {"n": 1}
    gi._index.cache_clear()  # a new process: read back from disk, not parsed
    assert gi.gguf_index(path).config == {"n": 1} and len(calls) == 1
    assert gi.cache_file(path).is_file()
    path.write_bytes(b"GGUF" + b"\1" * 61)  # changed file (size and mtime)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    gi._index.cache_clear()
    assert gi.gguf_index(path).config == {"n": 2} and len(calls) == 2
    gi._index.cache_clear()


def test_not_a_gguf_file_names_it(tmp_path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\3\4 not gguf")
    with pytest.raises(ValueError, match=f"not a GGUF file: {bad}"):
        gi.gguf_index(bad)
