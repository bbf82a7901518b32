"""roofline: an LLM inference and serving engine measured against the hardware's roofline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roofline.entrypoints.llm import LLM
    from roofline.outputs import CompletionOutput, RequestOutput
    from roofline.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "roofline.entrypoints.llm",
    "SamplingParams": "roofline.sampling_params",
    "RequestOutput": "roofline.outputs",
    "CompletionOutput": "roofline.outputs",
}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: ``roofline --version`` or ``--help`` (and any
    ``roofline.<submodule>`` import) does not pay for torch."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'roofline' has no attribute {name!r}")
