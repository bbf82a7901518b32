"""Programmatic dependent launch (PDL, Hopper and later): the switch and the device helpers.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream
is still running, once every program of that kernel has executed
``griddepcontrol.launch_dependents`` (or exited). Such a kernel must execute
``griddepcontrol.wait`` (which returns when the previous kernel has completed and its writes
are visible) before it reads anything the previous kernel wrote and before it writes anything.
Before the wait it may only touch data no earlier kernel of the step writes (the skinny GEMM
prefetches its weight rows into L2 there). Every kernel that launches this way waits, so a
waiting kernel's predecessor has itself waited for its own: completion is transitive down the
chain, and an early trigger anywhere is safe.

``ROOFLINE_PDL``: ``1`` on, ``0`` off, ``auto`` (the default) on from compute capability 9.0.
``set_pdl`` switches it for kernels launched from then on (benchmarks compare both). The
kernels that take part are ``kernels.gemv`` (skinny GEMMs), ``kernels.gemv_preload``,
``kernels.kv_store`` (``rotary_kv_store``), ``kernels.decode_attention_fused``,
``kernels.lm_head_argmax``, ``kernels.rmsnorm`` (the final norm before the LM head), the MoE router
and the int4 GEMV.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# On by default where the GPU has it. H100 (scripts/gpu_kernels.py): batch-1 decode Qwen3-0.6B
# 893 -> 922 tok/s, Llama-3.1-8B 170.7 -> 172.1 tok/s, logprobs bit-equal to the launches without.
_PDL_SETTING = os.environ.get("ROOFLINE_PDL", "auto")
_PDL: bool | None = None  # resolved at the first launch (needs the CUDA device)


def pdl_enabled() -> bool:
    """Whether the participating kernels launch as programmatic dependents."""
    global _PDL
    if _PDL is None:
        _PDL = _PDL_SETTING == "1" or (_PDL_SETTING == "auto" and _has_pdl())
    return _PDL


def _has_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def set_pdl(enabled: bool) -> None:
    """Turn PDL launches on or off for kernels launched from now on."""
    global _PDL
    _PDL = enabled and _has_pdl()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the lines at ``ptrs`` in L2 (PTX ``prefetch.global.L2``; nothing is returned)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
