"""Compile-at-first-use loader for the CPU kernels (``quant_gemm.c``: quantized GEMMs, with
``rows16.inc``; ``pool.c``: their thread pool; ``decoder.c``: a whole decode step of a
Llama-family model).

The C source is compiled once with the system C compiler (``$CC``, else ``cc``/``gcc``) into a
shared library cached under ``~/.cache/roofline/kernels/`` (``ROOFLINE_CACHE_DIR`` moves it),
named by a hash of the source, the compiler's path, size and mtime, and the flags: a changed
source or compiler builds a fresh one, an unchanged one loads in about a millisecond. The
library holds every ISA path (each function compiled for its own target), so one build serves
every CPU; ``rl_best_isa()`` reports the widest path this CPU can run. No compiler, or a
failed build, gives ``None`` and callers fall back to plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("quant_gemm.c", "pool.c", "decoder.c"))
INCLUDES = tuple(
    Path(__file__).with_name(f) for f in ("rows16.inc", "gemm16_512.inc", "attend512.inc")
)
"""Files the sources include (part of the cache key, not compiled on their own)."""
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-pthread", "-fno-math-errno")
ISA_NAMES = ("generic", "avx2", "avx512vnni")


def cache_root() -> Path:
    return Path(os.environ.get("ROOFLINE_CACHE_DIR", Path.home() / ".cache" / "roofline"))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` from the current source is cached."""
    st = Path(compiler).resolve().stat()
    key = hashlib.sha256()
    for source in (*SOURCES, *INCLUDES):
        key.update(source.read_bytes())
    key.update(f"{Path(compiler).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    key.update(" ".join(FLAGS).encode())
    return cache_root() / "kernels" / f"quant_gemm-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent process sees all of it or nothing


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rl_best_isa.restype = i32
    lib.rl_best_isa.argtypes = []
    lib.rl_set_threads.restype = i32
    lib.rl_set_threads.argtypes = [i32]
    lib.rl_quantize_rows.restype = None
    lib.rl_quantize_rows.argtypes = [p, i64, i64, i64, i32, i32, p, p, p]
    lib.rl_gemm_gguf.restype = None
    lib.rl_gemm_gguf.argtypes = [i32, p, i64, i64, p, i32, p, p, i64, p, i64, p, i32]
    lib.rl_gemm_canonical.restype = None
    canonical = [i32, p, p, p, i32, i64, i64, i64, p, i32, p, p, i64, p, i64, p, i32]
    lib.rl_gemm_canonical.argtypes = canonical
    lib.rl_linear_gguf.restype = i32
    lib.rl_linear_gguf.argtypes = [i32, p, i64, i64, p, i64, i64, i32, i32, p, i64, p, i32]
    lib.rl_dequant_gguf_rows.restype = None
    lib.rl_dequant_gguf_rows.argtypes = [i32, p, i64, i64, p]
    lib.rl_layer_field.restype = i32
    lib.rl_layer_field.argtypes = [i32]
    lib.rl_config_fields.restype = i32
    lib.rl_config_fields.argtypes = []
    lib.rl_argmax_rows.restype = None
    lib.rl_argmax_rows.argtypes = [p, i64, i64, i64, p]
    lib.rl_decode_step.restype = i32
    lib.rl_decode_step.argtypes = [p, p, p, p, p, ctypes.c_float, i64, p, p, p, p, p, i64, p]


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None without a working compiler (or
    with ``ROOFLINE_CPU_KERNELS=0``), in which case callers use the plain-torch path."""
    if os.environ.get("ROOFLINE_CPU_KERNELS", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU quantized GEMMs use the plain-torch path")
        return None
    target = library_path(compiler)
    try:
        if not target.is_file():
            logger.info(
                "compiling the CPU kernels with %s (once per source and compiler)", compiler
            )
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernels unavailable, using plain torch: %s", e)
        return None
    _declare(lib)
    import torch

    lib.rl_set_threads(max(1, torch.get_num_threads()))
    return lib


def loaded_library() -> ctypes.CDLL | None:
    """The library if this process has already loaded it (never builds it)."""
    return load_library() if load_library.cache_info().currsize else None


def best_isa() -> str:
    """The widest vector path this CPU runs (``generic`` without the library)."""
    lib = load_library()
    return ISA_NAMES[lib.rl_best_isa()] if lib is not None else "generic"
