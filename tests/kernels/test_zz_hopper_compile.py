"""The kernels the interpreter ran in this session compile for Hopper (``hopper_compile``).

Named to run after the other kernel tests of this directory, whose launches it compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import hopper_compile
import pytest

_BAD = """
import triton
import triton.language as tl


@triton.jit
def bad(x_ptr, n, BLOCK: tl.constexpr):
    BLOCK = BLOCK // 2  # the interpreter runs this; the GPU compiler refuses it
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def good(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)
"""


def test_the_check_fails_a_kernel_only_the_gpu_compiler_rejects(tmp_path):
    (tmp_path / "hopper_check_kernels.py").write_text(textwrap.dedent(_BAD))
    sig = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    entries = [
        {"kernel": f"hopper_check_kernels:{name}", "signature": sig,
         "constexprs": {"BLOCK": 128}, "options": {"num_warps": 4}}
        for name in ("bad", "good")
    ]  # fmt: skip
    path = tmp_path / "entries.json"
    path.write_text(json.dumps(entries))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(tmp_path)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    subprocess.run([sys.executable, hopper_compile.__file__, str(path), "1"], env=env,
                   check=True, timeout=300)  # fmt: skip
    failures = json.loads((tmp_path / "entries.json.failures").read_text())
    assert [kernel for kernel, _ in failures] == ["hopper_check_kernels:bad"]


def test_every_interpreted_kernel_compiles_for_sm90():
    if not hopper_compile.recorded:
        pytest.skip("no kernel ran in the interpreter before this test (run tests/kernels)")
    num, failures = hopper_compile.compile_all()
    print(f"{num} launches of {len(hopper_compile.recorded)} kernels compiled for sm_90")
    assert num > 0
    assert not failures, "\n\n".join(f"{kernel}:\n{error}" for kernel, error in failures)
