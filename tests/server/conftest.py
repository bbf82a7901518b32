"""Fixtures. Loading SmolLM2 dominates the cost on a 2-core CPU, so the session starts one
server: ``server`` runs the real app on a loopback port (an API key, a 1 MiB body limit) in this
process, with its engine core in a child process, as ``roofline serve`` does (same default
settings). ``offline`` runs an offline ``LLM`` with the same settings in this process for the
greedy reference answers. The ``roofline serve`` subprocess itself is exercised with a tiny
random-weight model (``tiny_model``), which also backs the servers that inject faults into
their core or need tiny queue limits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

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
    TINY_KV_BYTES,
    Served,
    crash_add_of_crash,
    run_in_thread,
)

from roofline import LLM, RequestOutput, SamplingParams
from roofline.engine.args import EngineArgs
from roofline.engine.async_engine import AsyncLLMEngine
from roofline.entrypoints.openai.server import build_app


@pytest.fixture(scope="session")
def server() -> Iterator[Served]:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs())
    try:
        app = build_app(engine, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
        with run_in_thread(app) as base_url:
            yield Served(base_url, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def offline() -> dict[str, list[RequestOutput]]:
    """Offline greedy answers for ``PROMPTS`` and ``CHATS`` (``LLM.generate`` / ``LLM.chat``),
    only in the sessions that need them."""
    llm = LLM()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {
        "completions": llm.generate(PROMPTS, greedy, use_tqdm=False),
        "chat": llm.chat(CHATS, greedy, use_tqdm=False),
        # one prompt on its own, as a lone server request runs it: the CPU's block kernels do
        # not promise the same bits for a row whatever else is in its batch
        "completion_1_alone": llm.generate([PROMPTS[1]], greedy, use_tqdm=False),
    }


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config.json of a tiny Llama (random weights, no tokenizer: token-id prompts)."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture(scope="session")
def tiny_core(tiny_model: str) -> Iterator[AsyncLLMEngine]:
    """A tiny engine core process shared by the tests that do not break it (its adds of id
    ``crash`` fail, see ``crash_add_of_crash``)."""
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model, kv_cache_memory_bytes=TINY_KV_BYTES),
        core_setup=crash_add_of_crash,
    )
    try:
        yield engine
    finally:
        engine.shutdown()
