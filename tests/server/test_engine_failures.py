"""Failure paths, on a tiny random-weight model whose engine core runs in a child process (faults
are injected there with ``core_setup`` hooks from ``server_utils``): a full waiting queue
answers 429; a step that raises, or a core process that is killed, ends the engine (streams get
an error event then ``[DONE]``, ``/health`` and new requests answer 503, the API process keeps
answering); bad or crashing adds never kill the loop; aborts are idempotent and free the KV
pages; slow consumers get merged deltas; the in-process (thread) core serves the same tokens;
and the ``roofline serve`` command starts, serves and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from server_utils import (
    TINY_KV_BYTES,
    ServerProcess,
    assert_openai_error,
    child_pids,
    fail_fifth_step,
    metrics,
    pid_alive,
    run_in_thread,
    slow_steps,
    wait_idle,
)

from roofline.engine.args import EngineArgs
from roofline.engine.async_engine import AsyncLLMEngine, EngineDeadError
from roofline.entrypoints.openai.server import build_app
from roofline.sampling_params import SamplingParams


def tiny_engine(model: str, setup: object = None, **kwargs: object) -> AsyncLLMEngine:
    args = EngineArgs(model=model, kv_cache_memory_bytes=TINY_KV_BYTES, **kwargs)  # type: ignore[arg-type]
    return AsyncLLMEngine.from_engine_args(args, core_setup=setup)  # type: ignore[arg-type]


def body(max_tokens: int, **fields: object) -> dict[str, object]:
    return {
        "prompt": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_full_waiting_queue_answers_429(tiny_model: str) -> None:
    # slow steps keep the first request running while the queue fills up
    engine = tiny_engine(tiny_model, slow_steps, max_num_seqs=1, max_num_waiting=1)
    try:
        with (
            run_in_thread(build_app(engine)) as url,
            httpx.Client(base_url=url, timeout=120) as http,
        ):
            with http.stream("POST", "/v1/completions", json=body(250, stream=True)) as first:
                lines = first.iter_lines()  # (a discarded iterator would close the stream)
                next(lines)  # running now: it streams
                second = threading.Thread(
                    target=lambda: http.post("/v1/completions", json=body(2)), daemon=True
                )
                second.start()
                deadline = time.monotonic() + 30
                while metrics(url)["roofline:num_requests_waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                err = assert_openai_error(http.post("/v1/completions", json=body(2)), 429)
                assert err["code"] == "queue_full"
            second.join(60)  # the first stream was closed (aborted): the second one ran
            assert not second.is_alive()
            assert wait_idle(url)["roofline:kv_cache_usage_perc"] == 0
            assert http.post("/v1/completions", json=body(3)).status_code == 200
    finally:
        engine.shutdown()


def _assert_dead_but_answering(http: httpx.Client, engine: AsyncLLMEngine) -> None:
    assert engine.is_dead
    err = assert_openai_error(http.get("/health"), 503)
    assert err["code"] == "engine_dead"
    assert_openai_error(http.post("/v1/completions", json=body(2)), 503)
    assert_openai_error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
        503,
    )
    assert http.get("/v1/models").status_code == 200  # the API process itself is fine
    assert http.get("/metrics").status_code == 200


def test_step_failure_kills_engine_and_reports(tiny_model: str) -> None:
    engine = tiny_engine(tiny_model, fail_fifth_step)
    try:
        with (
            run_in_thread(build_app(engine)) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions", json=body(50, stream=True)) as r:
                assert r.status_code == 200
                payloads = sse_payloads(r)
            assert payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])
            assert set(error) == {"error"} and "injected step failure" in error["error"]["message"]
            assert all("choices" in json.loads(p) for p in payloads[:-2])
            _assert_dead_but_answering(http, engine)
            assert "injected step failure" in http.get("/health").json()["error"]["message"]
    finally:
        engine.shutdown()
    assert not pid_alive(engine.core_pid)


def test_killed_core_process_is_detected(tiny_model: str) -> None:
    engine = tiny_engine(tiny_model, slow_steps)
    try:
        with (
            run_in_thread(build_app(engine)) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            with http.stream("POST", "/v1/completions", json=body(200, stream=True)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                os.kill(engine.core_pid, signal.SIGKILL)
                payloads = [x[len("data: ") :] for x in lines if x.startswith("data: ")]
            assert payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])["error"]
            assert error["code"] == "engine_dead" and "signal 9" in error["message"], error
            _assert_dead_but_answering(http, engine)
            with pytest.raises(EngineDeadError):
                asyncio.run(engine.add_request("late", [5], SamplingParams()))
    finally:
        engine.shutdown()


def test_bad_add_requests_never_kill_the_loop(tiny_core: AsyncLLMEngine) -> None:
    engine = tiny_core

    async def scenario() -> None:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("bad-vocab", [10**6], params)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad-empty", [], params)
        with pytest.raises(ValueError, match="no tokenizer"):
            await engine.add_request("bad-text", "hello", params)
        with pytest.raises(ValueError, match="context length"):
            await engine.add_request("too-long", [5] * 250, SamplingParams(max_tokens=100))
        with pytest.raises(TypeError, match="injected add failure"):  # raised in the core
            await engine.add_request("crash", [5, 6], params)
        outputs = [o async for o in engine.generate([5, 6], params, "good")]
        assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 3
        assert outputs[-1].prompt_token_ids == [5, 6]
        with pytest.raises(ValueError, match="already in use"):  # ids are per live request
            stream = await engine.add_request("dup", [5], SamplingParams(max_tokens=50))
            await engine.add_request("dup", [5], params)
        engine.abort(stream.request_id)

    asyncio.run(scenario())
    assert not engine.is_dead


async def _wait_freed(engine: AsyncLLMEngine) -> None:
    for _ in range(500):
        stats = engine.get_stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not freed: {engine.get_stats()}")


def test_abort_is_idempotent_and_frees_kv(tiny_core: AsyncLLMEngine) -> None:
    engine = tiny_core

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = await engine.add_request("r1", [5, 6, 7], params)
        first = await stream.__anext__()
        assert not first.finished
        assert engine.get_stats().kv_cache_usage > 0
        for _ in range(3):
            engine.abort("r1")
        engine.abort("never-existed")
        await _wait_freed(engine)  # the core freed the request and said so
        done = [o async for o in engine.generate([9, 9], SamplingParams(max_tokens=2), "r2")]
        assert done[-1].finished
        engine.abort("r2")  # after it finished

    asyncio.run(scenario())
    assert not engine.is_dead and engine.num_active_streams == 0


def test_slow_consumer_gets_merged_deltas(tiny_core: AsyncLLMEngine) -> None:
    engine = tiny_core
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)

    async def scenario() -> tuple[list, list]:
        fast = [o async for o in engine.generate([7, 8, 9], params, "fast")]
        stream = await engine.add_request("slow", [7, 8, 9], params)
        deadline = time.monotonic() + 60.0
        while not (stream._pending is not None and stream._pending.finished):  # noqa: SLF001
            assert time.monotonic() < deadline, "the request did not finish within 60 s"
            await asyncio.sleep(0.01)  # the consumer reads nothing until the request is done
        slow = [o async for o in stream]
        return fast, slow

    fast, slow = asyncio.run(scenario())
    assert len(fast) > 1 and len(slow) == 1 and slow[-1].finished  # every delta merged
    for outs in (fast, slow):
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(tokens) == 40 and tokens == [t for o in fast for t in o.outputs[0].token_ids]
        assert sum(len(o.outputs[0].logprobs) for o in outs) == 40
    assert slow[-1].outputs[0].cumulative_logprob == pytest.approx(
        fast[-1].outputs[0].cumulative_logprob
    )
    assert slow[-1].outputs[0].finish_reason == "length"


def test_in_process_core_serves_the_same_tokens(tiny_model: str, tiny_core: AsyncLLMEngine) -> None:
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model, kv_cache_memory_bytes=TINY_KV_BYTES), in_process=True
    )
    assert engine.core_pid == os.getpid()
    req = body(12, logprobs=1, stream=True, stream_options={"include_usage": True})
    answers = []
    try:
        for e in (engine, tiny_core):
            with run_in_thread(build_app(e)) as url:
                with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=60) as r:
                    chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == 12
            answers.append([t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]])
    finally:
        engine.shutdown()
    assert len(answers[0]) == 12 and answers[0] == answers[1]  # "<id>": no tokenizer
    with pytest.raises(EngineDeadError):  # a stopped engine refuses new work
        asyncio.run(engine.add_request("late", [5], SamplingParams()))


def test_roofline_serve_command(tiny_model: str) -> None:
    proc = ServerProcess(
        tiny_model,
        "--load-format",
        "dummy",
        "--kv-cache-memory-bytes",
        str(TINY_KV_BYTES),
        "--served-model-name",
        "tiny-test",
        "--max-num-seqs",
        "4",
        "--max-seqs-per-request",
        "3",
    )
    try:
        proc.wait_ready(timeout=300)
        children = child_pids(proc.proc.pid)
        assert children  # the engine core (and multiprocessing's resource tracker)
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            models = http.get("/v1/models").json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-test", 256)]
            r = http.post("/v1/completions", json={**body(4), "model": "tiny-test", "n": 2})
            assert r.status_code == 200, r.text
            too_many = http.post("/v1/completions", json={**body(4), "n": 4})
            assert assert_openai_error(too_many, 400)["code"] == "too_many_sequences"
            assert r.json()["usage"] == {
                "prompt_tokens": 4,
                "completion_tokens": 8,
                "total_tokens": 12,
            }
            # no tokenizer: text prompts and chat are refused cleanly
            assert_openai_error(http.post("/v1/completions", json={"prompt": "hi"}), 400)
            assert_openai_error(
                http.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                ),
                400,
            )
            assert "roofline:num_requests_running" in http.get("/metrics").text
    finally:
        proc.stop()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if pid_alive(p)], "the server left a process behind"
