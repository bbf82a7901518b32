"""Every Triton kernel the interpreter ran in a test session, compiled for Hopper (sm_90).

The CPU interpreter executes a kernel's Python: it accepts code that Triton's GPU compiler
rejects (a reassigned ``tl.constexpr``, a dtype the lowering does not support, a layout
conversion that does not exist), so a kernel can pass every parity test here and fail on the
first GPU launch. :func:`install_recorder` wraps the interpreter's launch and records each
roofline kernel with the types of its arguments (``triton.runtime.jit.mangle_type``, the JIT's
own specialisation), its constexprs and launch options; :func:`compile_all` compiles a few
distinct specialisations of each in a fresh process (no ``TRITON_INTERPRET``, so kernels are
real ``JITFunction``\\ s) for ``GPUTarget("cuda", 90, 32)``, through ptxas, the full pipeline a
GPU launch runs, and returns the failures.

    python tests/kernels/hopper_compile.py RECORDED.json [JOBS]    (what compile_all runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

MAX_PER_KERNEL = 2
"""Distinct specialisations compiled per kernel (the first ones the tests launched)."""
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")

recorded: dict[str, list[dict[str, Any]]] = {}
"""``module:qualname`` -> distinct launches (signature, constexprs, options)."""
_skipped: set[str] = set()


def _constexpr_value(value: Any) -> Any:
    """A JSON-able constexpr, or raise TypeError."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None)  # a tl.dtype
    if type(value).__name__ == "dtype" and isinstance(name, str):
        return {"tl_dtype": name}
    raise TypeError(type(value).__name__)


def record_launch(fn: Any, arg_names: list[str], args: tuple, kwargs: dict) -> None:
    """Remember one interpreted launch of ``fn`` (a roofline ``@triton.jit`` function)."""
    from triton.runtime.jit import mangle_type

    key = f"{fn.__module__}:{fn.__qualname__}"
    if not fn.__module__.startswith("roofline.") or key in _skipped:
        return
    launches = recorded.setdefault(key, [])
    if len(launches) >= MAX_PER_KERNEL:
        return
    import inspect

    import triton.language as tl

    params = inspect.signature(fn).parameters
    values = dict(zip(arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in params})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    try:
        for name, p in params.items():
            if name not in values:
                if p.default is inspect.Parameter.empty:
                    raise TypeError(f"argument {name} missing")
                value = p.default
            else:
                value = values[name]
            is_const = p.annotation is tl.constexpr or p.annotation == "tl.constexpr"
            if is_const or value is None:
                signature[name] = "constexpr"
                constexprs[name] = _constexpr_value(value)
            else:
                signature[name] = mangle_type(value)
    except TypeError:
        _skipped.add(key)  # an argument this check cannot describe
        if not launches:
            del recorded[key]
        return
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs and kwargs[k] is not None}
    entry = {"kernel": key, "signature": signature, "constexprs": constexprs, "options": options}
    if entry not in launches:
        launches.append(entry)


def install_recorder() -> bool:
    """Wrap the interpreter's kernel launch (once); False when Triton is not interpreting."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "_roofline_recording", False):
        return True

    def recording_run(self, *args, grid, warmup, **kwargs):
        try:
            record_launch(self.fn, self.arg_names, args, kwargs)
        except Exception:  # noqa: BLE001 - the recorder never breaks a test
            pass
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._roofline_recording = True  # type: ignore[attr-defined]
    InterpretedFunction.run = recording_run
    return True


def _compile_one(entry: dict[str, Any]) -> str | None:
    """Compile one recorded launch for sm_90; the error text, or None when it compiled."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module_name, qualname = entry["kernel"].split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):  # autotuner / heuristics wrappers
        obj = obj.fn
    consts = {
        k: getattr(tl, v["tl_dtype"]) if isinstance(v, dict) else v
        for k, v in entry["constexprs"].items()
    }
    try:
        triton.compile(
            ASTSource(obj, entry["signature"], consts),
            target=GPUTarget("cuda", 90, 32),
            options=entry["options"],
        )
    except Exception as e:  # noqa: BLE001 - reported per kernel
        return f"{type(e).__name__}: {str(e)[-1500:]}"
    return None


def compile_entries(entries: list[dict[str, Any]], jobs: int = 2) -> list[tuple[str, str]]:
    """(kernel, error) for each entry that failed to compile (in this process's pool)."""
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        errors = list(pool.map(_compile_one, entries))
    return [(e["kernel"], err) for e, err in zip(entries, errors) if err is not None]


def compile_all(jobs: int = 2, timeout_s: float = 600.0) -> tuple[int, list[tuple[str, str]]]:
    """Compile everything recorded in a fresh process; (entries compiled, failures)."""
    entries = [e for launches in recorded.values() for e in launches]
    if not entries:
        return 0, []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "recorded.json")
        with open(path, "w") as f:
            json.dump(entries, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "cache"))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), path, str(jobs)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            return len(entries), [("(the compile process)", proc.stderr[-3000:])]
        with open(path + ".failures") as f:
            failures = [tuple(x) for x in json.load(f)]
    return len(entries), failures  # type: ignore[return-value]


def main(argv: list[str]) -> int:
    path = argv[0]
    jobs = int(argv[1]) if len(argv) > 1 else 2
    with open(path) as f:
        entries = json.load(f)
    failures = compile_entries(entries, jobs)
    with open(path + ".failures", "w") as f:
        json.dump(failures, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
