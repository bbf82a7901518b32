"""The compiled-kernel cache keys of interpreted Triton launches, recorded without running them.

A compiled ``JITFunction`` looks a launch up in its kernel cache by a key of each argument's
specialisation (its type; for integers whether they equal 1 or divide by 16, for pointers
whether they are 16-byte aligned, except the parameters named in ``do_not_specialize``), the
constexprs and the launch options: a key not seen before compiles. Under ``TRITON_INTERPRET=1``
kernels are ``InterpretedFunction``\\ s, which have no cache; :func:`recording` wraps their launch
and computes the key the compiled kernel would use, with Triton's own binder (its
``create_function_from_signature`` over the kernel's parameters), and with ``run=False`` skips
the launch itself, so a whole model's steps cost only their torch work (outputs of skipped kernels
are left as allocated: use it only where no control flow depends on them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple


class LaunchKey(NamedTuple):
    kernel: str
    specialization: tuple[tuple[str, str], ...]
    """(parameter name, its specialisation) per parameter, in order."""
    options: str

    def diff(self, others: set[LaunchKey]) -> str:
        """How this key differs from the nearest of ``others`` of the same kernel."""
        same = [o for o in others if o.kernel == self.kernel]
        if not same:
            return f"{self.kernel}: never launched"

        def delta(o: LaunchKey) -> list[str]:
            out = [f"{n}={v} (not {w})" for (n, v), (_, w) in
                   zip(self.specialization, o.specialization, strict=True) if v != w]  # fmt: skip
            return out + ([f"options {self.options} (not {o.options})"]
                          if o.options != self.options else [])  # fmt: skip

        return f"{self.kernel}: " + ", ".join(min((delta(o) for o in same), key=len))


_BINDERS: dict[Any, Any] = {}


def _binder(fn: Any) -> Any:
    """Triton's binder for the interpreted kernel ``fn`` (an ``InterpretedFunction``)."""
    binder = _BINDERS.get(fn.fn)
    if binder is None:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        kwargs = {k: fn.kwargs[k] for k in ("do_not_specialize", "do_not_specialize_on_alignment")
                  if fn.kwargs.get(k)}  # fmt: skip
        jit = JITFunction(fn.fn, **kwargs)
        # CUDA's backend specialises as the base one does (alignment 16, divisibility 16)
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _BINDERS[fn.fn] = binder
    return binder


def launch_key(fn: Any, args: tuple, kwargs: dict) -> LaunchKey:
    _, specialization, options = _binder(fn)(*args, **kwargs)
    names = fn.arg_names
    spec = tuple((n, _describe(s)) for n, s in zip(names, specialization, strict=True))
    return LaunchKey(fn.fn.__name__, spec, repr(sorted(options.items())))


def _describe(spec: tuple) -> str:
    kind, value = spec[0], spec[1]
    if kind == "constexpr":
        return f"{getattr(value, 'name', value)!s}"
    return f"{kind}:{value}" if value else str(kind)


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[LaunchKey]]:
    """Record the :class:`LaunchKey` of every interpreted launch in the block (in order);
    ``run``: launch them too (else they are skipped)."""
    from triton.runtime.interpreter import InterpretedFunction

    keys: list[LaunchKey] = []
    original = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003
        keys.append(launch_key(self, args, kwargs))
        if run:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = recording_run
    try:
        yield keys
    finally:
        InterpretedFunction.run = original
