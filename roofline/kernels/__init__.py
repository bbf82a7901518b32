"""Triton kernels for the hot paths of a decoder step, each beside its plain-torch reference.

Every module holds one kernel family: the ``@triton.jit`` kernel(s), a Python launcher that
checks shapes and picks block sizes, and a ``*_ref`` function in plain torch that defines what
the kernel must compute (the parity tests in ``tests/kernels`` compare the two). Launchers need
CUDA tensors, or ``TRITON_INTERPRET=1`` set before these modules are imported (then they also
run on CPU tensors, slowly; the tests use this on machines without a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

# H100 SXM; used when no CUDA device is present (interpreter runs) so split heuristics still work.
DEFAULT_NUM_SMS = 132


def is_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse tensors a Triton launch cannot use, with a clear message instead of a crash."""
    for t in tensors:
        if not t.is_cuda and not is_interpret():
            raise RuntimeError(
                "roofline Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                f"roofline.kernels is imported); got a tensor on {t.device}"
            )


@functools.lru_cache(maxsize=8)
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (DEFAULT_NUM_SMS for non-CUDA devices)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_of(index)


@contextlib.contextmanager
def count_jit_compiles() -> Iterator[list[str]]:
    """Collect the names of Triton kernels specialized (compiled, or loaded from Triton's disk
    cache) in this process while the block runs. A serving run should find none: every
    specialization it needs belongs in the engine's start-up warm-up, not in a request's
    latency."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing can compile
        yield names
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", "?"))
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def _fix_interpreter() -> None:
    """Patch two gaps of Triton 3.6's CPU interpreter (compiled GPU kernels are unaffected).

    * It holds a scalar as a numpy array of shape (1,) and converts it with ``int(array)``, which
      numpy >= 2.4 refuses, so ``for i in range(start, end)`` with run-time bounds fails; we
      convert through the array's single element instead.
    * Its ``tl.dot`` multiplies bf16 operands as their raw uint16 bits; we widen them to fp32
      first (exact), which is what the tensor cores compute with fp32 accumulation.
    * It casts fp32 to bf16 by truncation; the GPU (and torch) round to nearest even, which we
      do instead so that bit-exact tests mean the same on both.
    """
    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "_roofline_fixed", False):
        return

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen_bf16(handle):
        if handle.dtype.scalar.name != "bf16":
            return handle.data
        bits = handle.data.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar.name == "bf16" or b.dtype.scalar.name == "bf16":
            a = interpreter.TensorHandle(widen_bf16(a), interpreter.tl.float32)
            b = interpreter.TensorHandle(widen_bf16(b), interpreter.tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar.name != "fp32" or dst_type.scalar.name != "bf16":
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        is_nan = np.isnan(src.data)
        out = np.where(is_nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
        return interpreter.TensorHandle(out, dst_type.scalar)

    patched_tensor._roofline_fixed = True
    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.cast_impl = patched_cast


if is_interpret():
    _fix_interpreter()
