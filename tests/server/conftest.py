"""Fixtures. Loading SmolLM2 dominates the cost on a 2-core CPU, so the session loads it once:
``server`` serves the engine of one offline ``LLM`` (same settings as ``roofline serve`` builds)
through the real app on a loopback port, with an API key and a 1 MiB body limit, and
``offline`` runs that ``LLM`` for the greedy reference answers. The ``roofline serve`` subprocess
itself is exercised with a tiny random-weight model (``tiny_model``), which also backs the
in-process servers that inject faults or need tiny queue limits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import (
    API_KEY,
    CHATS,
    MAX_BODY_BYTES,
    MAX_TOKENS,
    PROMPTS,
    TINY_CONFIG,
    Served,
    run_in_thread,
)

from roofline import LLM, RequestOutput, SamplingParams
from roofline.engine.async_engine import AsyncLLMEngine
from roofline.entrypoints.openai.server import build_app


@pytest.fixture(scope="session")
def _llm() -> LLM:
    return LLM()


@pytest.fixture(scope="session")
def server(_llm: LLM) -> Iterator[Served]:
    engine = AsyncLLMEngine(_llm.llm_engine)
    app = build_app(engine, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    try:
        with run_in_thread(app) as base_url:
            yield Served(base_url, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def offline(_llm: LLM, server: Served) -> dict[str, list[RequestOutput]]:
    """Offline greedy answers for ``PROMPTS`` and ``CHATS``: ``LLM.generate`` / ``LLM.chat``
    on the server's own engine, run on its engine thread (the engine is not thread-safe) while
    the server is idle, only in the sessions that need them."""
    assert server.engine.num_active_streams == 0
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def run(_: object) -> dict[str, list[RequestOutput]]:
        return {
            "completions": _llm.generate(PROMPTS, greedy, use_tqdm=False),
            "chat": _llm.chat(CHATS, greedy, use_tqdm=False),
        }

    return asyncio.run(server.engine.run_in_engine(run))


@pytest.fixture(scope="session")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300
    )


@pytest.fixture(scope="session")
def http(server: Served) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        yield c


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    """A config.json of a tiny Llama (random weights, no tokenizer: token-id prompts)."""
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)
