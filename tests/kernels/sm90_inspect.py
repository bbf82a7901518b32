"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU and inspect what the
GPU would run: Triton's CUDA backend and its bundled ``ptxas`` work on the CPU.
``test_zz_hopper_compile`` checks that every interpreted launch compiles; this goes further for
one kernel's chosen configs: which wgmma forms it uses, whether the A operand comes from
registers, and how many registers ptxas allots and spills.

``compile_sm90(fn, signature, constexprs, num_warps)`` marks every pointer and the integer
arguments named in ``divisible`` as multiples of 16, as a launch with aligned tensors and such
sizes specializes them."""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget


def compile_sm90(
    fn,
    signature: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int,
    divisible: tuple[str, ...] = (),
):
    names = list(fn.arg_names)
    sig = {name: signature.get(name, "constexpr") for name in names}
    attrs = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name, kind in sig.items()
        if kind.startswith("*") or name in divisible
    }
    source = triton.compiler.ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )


def wgmma_forms(kernel) -> list[str]:
    """The distinct wgmma MMA instructions (shape and types) in the kernel's PTX."""
    return sorted(set(re.findall(r"wgmma\.mma_async[\w.]+", kernel.asm["ptx"])))


def uses_register_a(kernel) -> bool:
    """Whether some wgmma takes its A operand from registers (``{%r..}`` rather than a
    shared-memory descriptor)."""
    return bool(re.search(r"wgmma\.mma_async[\w.]+\s+\{[^}]*\},\s*\{", kernel.asm["ptx"]))


def ptxas_usage(kernel) -> tuple[int, int]:
    """(registers per thread, spill bytes stored) that ptxas reports for the kernel's PTX."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(kernel.asm["ptx"])
        src.flush()
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0
