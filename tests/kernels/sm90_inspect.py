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
    num_stages: int | None = None,
):
    names = list(fn.arg_names)
    sig = {name: signature.get(name, "constexpr") for name in names}
    attrs = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name, kind in sig.items()
        if kind.startswith("*") or name in divisible
    }
    source = triton.compiler.ASTSource(fn, sig, constexprs, attrs)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


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


def sass_lines(kernel) -> list[tuple[int, str]]:
    """(address, instruction) of the kernel's SASS (cuobjdump of its cubin, Triton's own)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _written_registers(ins: str) -> set[int]:
    """General registers an instruction writes (its first operand; 64/128-bit forms write 2/4)."""
    m = re.match(r"(@!?U?P\w+\s+)?([A-Z][\w.]*)\s+R(\d+)\b", ins)
    if not m or m.group(2).split(".")[0] in ("ST", "STS", "STG", "STL", "RED", "BRA", "HGMMA"):
        return set()
    op, first = m.group(2), int(m.group(3))
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(first, first + width))


def register_a_hazards(kernel) -> list[str]:
    """Instructions that overwrite a register-sourced wgmma A operand (``HGMMA ... Rn,`` reads
    Rn..Rn+3) before a ``WARPGROUP.DEPBAR.LE gsb0, N`` has retired that MMA, walking forward
    from each HGMMA and once around its loop (a backward branch): the pattern ptxas before 13.3
    emits for a pipelined register-operand wgmma (triton-lang/triton#9433), which gives wrong
    results when the MMA reads its operand late. The HGMMAs up to one marked ``gsb0`` form a
    group; ``DEPBAR.LE gsb0, N`` leaves the newest N groups in flight, so an MMA retires there
    once N groups have been committed after its own (N = 0: every MMA)."""
    return sass_register_a_hazards(sass_lines(kernel))


def sass_register_a_hazards(lines: list[tuple[int, str]]) -> list[str]:
    """``register_a_hazards`` on (address, instruction) lines."""
    index = {addr: i for i, (addr, _) in enumerate(lines)}
    found = []
    for i, (addr, ins) in enumerate(lines):
        m = re.search(r"HGMMA\.\S+\s+R\d+,\s+R(\d+),", ins)
        if not m:
            continue
        live = set(range(int(m.group(1)), int(m.group(1)) + 4))
        committed = "gsb0" in ins  # this MMA's group is committed
        newer = 0  # groups committed after it
        j, steps, wrapped = i + 1, 0, False
        while j < len(lines) and steps < 4000:
            a, nxt = lines[j]
            d = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", nxt)
            if d and newer >= int(d.group(1), 16):
                break
            if "HGMMA" in nxt and "gsb0" in nxt:
                if committed:
                    newer += 1
                committed = True
            if live & _written_registers(nxt):
                found.append(f"{a:#06x} {nxt}  (A operand of the HGMMA at {addr:#06x})")
                break
            b = re.search(r"BRA\s+0x([0-9a-f]+)", nxt)
            if b and not wrapped and int(b.group(1), 16) < a and int(b.group(1), 16) in index:
                j, wrapped = index[int(b.group(1), 16)], True  # once around the loop
            else:
                j += 1
            steps += 1
    return found


def report_in_subprocess(module: str, timeout: float = 600):
    """``module.hopper_report()`` (a test module beside this one) run in a fresh Python without
    TRITON_INTERPRET, so its kernels compile for sm_90 instead of being interpreted; its JSON
    result."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here), str(here.parents[1]), env.get("PYTHONPATH", "")]
    )
    code = f"import json, {module} as t; print(json.dumps(t.hopper_report()))"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
