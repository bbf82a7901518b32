"""Kernel parity tests run on CUDA when present, else in Triton's CPU interpreter on small shapes.

Without a GPU this conftest sets ``TRITON_INTERPRET=1`` before any test module imports a kernel.
``@triton.jit`` decides compiled vs interpreted when a kernel is *defined*, so kernel modules that
an earlier test directory already imported are reloaded here.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        # Triton was imported by an earlier test before the interpreter was on: its library
        # functions written in Triton (tl.cdiv, tl.sum, ...) are compiled-mode JITFunctions,
        # which an interpreted kernel cannot call. Rebind them as interpreted functions.
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for _mod_name in [m for m in sys.modules if m.startswith("triton.language")]:
            _mod = sys.modules[_mod_name]
            for _attr, _obj in list(vars(_mod).items()):
                if isinstance(_obj, JITFunction):
                    setattr(_mod, _attr, InterpretedFunction(_obj.fn))
    _stale = [m for m in sys.modules if m.startswith("roofline.kernels")]
    if "roofline.attention.triton_backend" in sys.modules:
        _stale.append("roofline.attention.triton_backend")
    # The package first (it patches the interpreter), then kernels, then the backend using them.
    # Twice: a kernel module that imports another's @triton.jit helper by name captures the
    # helper as it is at its reload; in the second pass every helper is already interpreted.
    for _pass in range(2):
        for _name in sorted(_stale, key=lambda n: (n != "roofline.kernels", "backend" in n, n)):
            importlib.reload(sys.modules[_name])
    # every kernel the interpreter runs is compiled for sm_90 at the end of tests/kernels
    # (test_zz_hopper_compile.py): the interpreter accepts code the GPU compiler rejects
    import hopper_compile

    hopper_compile.install_recorder()
