"""Failure paths, on a tiny random-weight model: a full waiting queue answers 429, a step that
raises kills the engine (streams get an error event then ``[DONE]``, ``/health`` and new
requests answer 503), bad or crashing ``add_request`` calls never kill the loop, aborts are
idempotent, and the ``roofline serve`` command starts and serves."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess, assert_openai_error, metrics, run_in_thread, wait_idle

from roofline.engine.args import EngineArgs
from roofline.engine.async_engine import AsyncLLMEngine, EngineDeadError
from roofline.entrypoints.openai.server import build_app
from roofline.sampling_params import SamplingParams

KV_BYTES = 4 << 20


def tiny_engine(model: str, **kwargs: object) -> AsyncLLMEngine:
    args = EngineArgs(model=model, kv_cache_memory_bytes=KV_BYTES, **kwargs)  # type: ignore[arg-type]
    return AsyncLLMEngine.from_engine_args(args)


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
    engine = tiny_engine(tiny_model, max_num_seqs=1, max_num_waiting=1)
    real_step = engine.engine.step

    def slow_step():  # keep the first request running while the queue fills up
        time.sleep(0.05)
        return real_step()

    engine.engine.step = slow_step  # type: ignore[method-assign]
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


def test_step_failure_kills_engine_and_reports(tiny_model: str) -> None:
    engine = tiny_engine(tiny_model)
    real_step = engine.engine.step
    calls = {"n": 0}

    def failing_step():  # fault injection: the 5th step raises
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.engine.step = failing_step  # type: ignore[method-assign]
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
            assert engine.is_dead
            err = assert_openai_error(http.get("/health"), 503)
            assert err["code"] == "engine_dead"
            assert_openai_error(http.post("/v1/completions", json=body(2)), 503)
            assert_openai_error(
                http.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                ),
                503,
            )
    finally:
        engine.shutdown()


def test_bad_add_requests_never_kill_the_loop(tiny_model: str) -> None:
    engine = tiny_engine(tiny_model)
    real_add = engine.engine.add_request

    async def scenario() -> None:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("bad-vocab", [10**6], params)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad-empty", [], params)
        with pytest.raises(ValueError, match="context length"):
            await engine.add_request("too-long", [5] * 250, SamplingParams(max_tokens=100))

        def crashing_add(*args: object, **kwargs: object) -> None:
            raise TypeError("injected add failure")

        engine.engine.add_request = crashing_add  # type: ignore[method-assign]
        with pytest.raises(TypeError, match="injected add failure"):
            await engine.add_request("crash", [5, 6], params)
        engine.engine.add_request = real_add  # type: ignore[method-assign]
        outputs = [o async for o in engine.generate([5, 6], params, "good")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        with pytest.raises(ValueError, match="already in use"):  # ids are per live request
            stream = await engine.add_request("dup", [5], SamplingParams(max_tokens=50))
            await engine.add_request("dup", [5], params)
        engine.abort(stream.request_id)

    try:
        asyncio.run(scenario())
        assert not engine.is_dead
    finally:
        engine.shutdown()


def test_abort_is_idempotent(tiny_model: str) -> None:
    engine = tiny_engine(tiny_model)

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = await engine.add_request("r1", [5, 6, 7], params)
        first = await stream.__anext__()
        assert not first.finished
        for _ in range(3):
            engine.abort("r1")
        engine.abort("never-existed")
        # the aborted stream ends without a final output; the engine frees the request
        for _ in range(200):
            stats = await engine.run_in_engine(lambda e: e.get_stats())
            if stats.num_running == 0 and stats.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.02)
        assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
        done = [o async for o in engine.generate([9, 9], SamplingParams(max_tokens=2), "r2")]
        assert done[-1].finished
        engine.abort("r2")  # after it finished

    try:
        asyncio.run(scenario())
        assert not engine.is_dead
        engine.shutdown()
        with pytest.raises(EngineDeadError):  # a stopped engine refuses new work
            asyncio.run(engine.add_request("late", [5], SamplingParams()))
    finally:
        engine.shutdown()


def test_roofline_serve_command(tiny_model: str) -> None:
    proc = ServerProcess(
        tiny_model,
        "--load-format",
        "dummy",
        "--kv-cache-memory-bytes",
        str(KV_BYTES),
        "--served-model-name",
        "tiny-test",
        "--max-num-seqs",
        "4",
    )
    try:
        proc.wait_ready(timeout=300)
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            models = http.get("/v1/models").json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-test", 256)]
            r = http.post("/v1/completions", json={**body(4), "model": "tiny-test", "n": 2})
            assert r.status_code == 200, r.text
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
