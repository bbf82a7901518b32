"""Helpers shared by the GPU scripts (``scripts/gpu_*.py``, run as ``python scripts/X.py``, so
this folder is on ``sys.path``): the sections that print a header, report a failure and go on to
the next section, and the result rows the scripts print and collect for their final table.
Importing this module needs no GPU (``free_cuda`` imports torch when a section ends).
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable


def sections(
    on_error: Callable[[str, Exception], None],
    footer: str = "({seconds:.1f} s)",
    free_cuda: bool = False,
) -> Callable:
    """A ``section(name)`` decorator: the wrapped call prints ``=== name``, returns what the
    function returns, or on an ``Exception`` prints the traceback, calls ``on_error(name, e)``
    and returns None; it then prints ``footer`` (``{name}``, ``{seconds}``) and, with
    ``free_cuda``, collects garbage and empties the CUDA cache."""

    def section(name: str):
        def wrap(fn):
            def run(*a, **kw):
                print(f"\n=== {name}", flush=True)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                except Exception as e:  # noqa: BLE001 - report and go on
                    traceback.print_exc()
                    on_error(name, e)
                finally:
                    print(footer.format(name=name, seconds=time.perf_counter() - t0), flush=True)
                    if free_cuda:
                        import torch

                        gc.collect()
                        torch.cuda.empty_cache()

            return run

        return wrap

    return section


def rows_and_sections(rows: list[tuple[str, str]]) -> tuple[Callable[[str, str], None], Callable]:
    """``row(name, value)``, which appends to ``rows`` and prints ``name: value``, and a
    ``section`` decorator whose failure is the row ``"<name> FAILED"``."""

    def row(name: str, value: str) -> None:
        rows.append((name, value))
        print(f"{name}: {value}", flush=True)

    def failed(name: str, e: Exception) -> None:
        row(f"{name} FAILED", f"{type(e).__name__}: {e}")

    return row, sections(failed)


def print_rows(script: str, rows: list[tuple[str, str]], seconds: float) -> None:
    """The final table: ``=== <script> summary (<seconds> s) ===``, then one aligned row a line."""
    print(f"\n=== {script} summary ({seconds:.0f} s) ===")
    width = max(len(n) for n, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


def profiled_steps(engine, warm: int, steps: int):
    """torch.profiler's record (CUDA activity) of ``steps`` engine steps, after ``warm`` steps
    outside it; the device synchronized before and after the profiled ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return prof
