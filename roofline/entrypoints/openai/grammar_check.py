"""The API process compiles each request's output constraint before the engine sees it, under
a time bound, so that a schema or regex the backend refuses, or one that would take too long,
is a 400 naming the field and never reaches the engine core (which compiles it again on its own
worker thread, from its own cache). The compile runs on a worker thread, off the event loop; a
compile that overruns ``COMPILE_TIMEOUT_S`` is answered 400 at once (the thread finishes in the
background, and its result stays cached).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roofline.entrypoints.openai.errors import OpenAIError
from roofline.structured_output.params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0


class GrammarChecker:
    def __init__(self, tokenizer: Any, vocab_size: int, backend: str = "auto") -> None:
        from roofline.structured_output.backend import make_backend

        if tokenizer is None:
            raise OpenAIError(400, "structured outputs need a tokenizer; this model has none")
        eos = getattr(tokenizer, "eos_token_id", None)
        self.backend = make_backend(backend, tokenizer, vocab_size, [] if eos is None else [eos])
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")

    async def check(self, params: StructuredOutputsParams) -> None:
        loop = asyncio.get_running_loop()
        field = params.field_name
        try:
            await asyncio.wait_for(
                loop.run_in_executor(self._pool, self.backend.compile, params), COMPILE_TIMEOUT_S
            )
        except asyncio.TimeoutError as e:
            raise OpenAIError(
                400,
                f"{field}: compiling the constraint took longer than {COMPILE_TIMEOUT_S:g} s",
                param=field,
            ) from e
        except ValueError as e:
            raise OpenAIError(400, str(e), param=field) from e


async def check_constraint(state: Any, params: StructuredOutputsParams | None) -> None:
    """400 unless ``params`` (if any) compiles in time for the served model's tokenizer."""
    if params is None:
        return
    if state.grammar_checker is None:
        engine = state.engine
        state.grammar_checker = await asyncio.to_thread(
            GrammarChecker,
            engine.tokenizer,
            engine.vocab_size,
            getattr(state, "structured_outputs_backend", "auto"),
        )
    await state.grammar_checker.check(params)
