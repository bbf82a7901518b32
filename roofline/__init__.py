"""roofline: an LLM inference and serving engine measured against the hardware's roofline."""

from __future__ import annotations

from roofline.entrypoints.llm import LLM
from roofline.outputs import CompletionOutput, RequestOutput
from roofline.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
