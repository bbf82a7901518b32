"""A GGUF file's metadata, read once and cached on disk beside the other per-model caches, so a
warm start never parses the header again.

Parsing a GGUF header with the ``gguf`` package walks every metadata value (a 49k-token
vocabulary and its merges: ~3.5 s on the 2-core dev machine). What a start needs from it is
small: the HF-style config dict, the chat template, and each tensor's name, type, shape and
byte range. :func:`gguf_index` returns those, from
``$ROOFLINE_CACHE_DIR/gguf/<key>.json`` when present; the key hashes the file's resolved path,
size and modification time, so a changed or replaced file is parsed afresh (and a new cache
entry written). :func:`tensor_bytes` then gives a tensor's stored bytes as a uint8 torch view of
a copy-on-write memory map of the file: nothing is read until a kernel touches it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CACHE_VERSION = 2


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    """GGUF tensor name (``blk.0.attn_q.weight``)."""
    type_name: str
    """GGML type name (``Q4_1``, ``F32``, ...)."""
    shape: tuple[int, ...]
    """HF order (outermost first): ``[out, in]`` for a weight."""
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    num_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    path: Path
    arch: str
    """``general.architecture`` (``llama``, ``qwen2``, ...)."""
    config: dict[str, Any]
    chat_template: str | None
    tensors: list[GGUFTensorInfo]


def cache_key(path: Path) -> str:
    st = path.stat()
    text = f"{CACHE_VERSION}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_file(path: Path) -> Path | None:
    if os.environ.get("ROOFLINE_NO_CACHE") == "1":
        return None
    root = Path(os.environ.get("ROOFLINE_CACHE_DIR", Path.home() / ".cache" / "roofline"))
    return root / "gguf" / f"{cache_key(path)}.json"


def _parse(path: Path) -> dict[str, Any]:
    from roofline.models import gguf_loader

    reader = gguf_loader.open_gguf(str(path))
    tensors = [
        {
            "name": t.name,
            "type_name": t.tensor_type.name,
            "shape": [int(n) for n in reversed(t.shape)],
            "offset": int(t.data_offset),
            "num_bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    return {
        "arch": str(gguf_loader.gguf_field(reader, "general.architecture")),
        "config": gguf_loader.gguf_config_dict(path),
        "chat_template": gguf_loader.gguf_chat_template(path),
        "tensors": tensors,
    }


@functools.lru_cache(maxsize=4)
def _index(path: str, key: str) -> GGUFIndex:
    p = Path(path)
    cached = cache_file(p)
    data = None
    if cached is not None and cached.is_file():
        try:
            data = json.loads(cached.read_text())
        except (OSError, ValueError):
            data = None
    if data is None:
        data = _parse(p)
        if cached is not None:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(data))
                os.replace(tmp, cached)
            except OSError:
                pass
    tensors = [
        GGUFTensorInfo(t["name"], t["type_name"], tuple(t["shape"]), t["offset"], t["num_bytes"])
        for t in data["tensors"]
    ]
    return GGUFIndex(p, data["arch"], data["config"], data["chat_template"], tensors)


def gguf_index(path: str | os.PathLike[str]) -> GGUFIndex:
    """The index of a GGUF file (cached in memory and on disk; see the module doc)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such GGUF file: {p}")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"not a GGUF file: {p}")
    return _index(str(p), cache_key(p))


@functools.lru_cache(maxsize=4)
def _file_map(path: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))  # [file bytes]


def tensor_bytes(index: GGUFIndex, info: GGUFTensorInfo) -> torch.Tensor:
    """uint8 [num_bytes] view of the tensor's stored data (memory-mapped, copy-on-write)."""
    return _file_map(str(index.path)).narrow(0, info.offset, info.num_bytes)
