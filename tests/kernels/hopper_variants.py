"""Compile chosen constexpr variants of a Triton kernel for Hopper (sm_90) on any machine:
Triton's front end, LLVM and the bundled ptxas. ``test_zz_hopper_compile.py`` compiles the
launches the interpreter ran; the variants only a GPU launches (PDL, PTX fences and roundings:
``PDL`` and PTX-only paths are off under the interpreter) are compiled here, by name. The compile
runs in a subprocess without ``TRITON_INTERPRET`` (the test process holds interpreted kernels).
Importing this module imports no kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def compile_for_hopper(
    module: str,
    kernel: str,
    variants: list[dict],
    pointers: dict[str, str],
    floats: tuple[str, ...] = (),
    options: dict | None = None,
) -> list[str]:
    """The sm_90 PTX of ``module.kernel`` for each dict of constexprs in ``variants``.

    ``pointers``: pointer argument -> element type (``"bf16"``, ``"fp32"``, ``"i32"``, ...);
    ``floats``: fp32 scalar arguments; every other argument is an i32 scalar or a constexpr.
    ``options``: ``num_warps``, ``num_stages``, ``enable_fp_fusion``, ...; a constexpr parameter
    with a default that a variant does not name is compiled at its default."""
    spec = dict(module=module, kernel=kernel, variants=variants, pointers=pointers,
                floats=list(floats), options=options or {})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(spec), env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"sm_90 compile failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def _main() -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = json.loads(sys.stdin.read())
    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    ptx = []
    defaults = {  # constexpr parameters with a default: compiled at it unless a variant names them
        p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default
    }
    for constexprs in spec["variants"]:
        constexprs = dict(defaults, **constexprs)
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in spec["pointers"]:
                signature[name] = "*" + spec["pointers"][name]
            else:
                signature[name] = "fp32" if name in spec["floats"] else "i32"
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs),
            target=GPUTarget("cuda", 90, 32),
            options=spec["options"],
        )
        ptx.append(compiled.asm["ptx"])
    print(json.dumps(ptx))


if __name__ == "__main__":
    _main()
