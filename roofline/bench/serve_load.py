"""The load side of ``roofline bench serve``: what to send and how it is sent.

Requests are synthetic (prompts of random common words, about one token each, with lengths from
a fixed, uniform, normal or exponential distribution) or read from a JSONL file. They are fired
at an OpenAI-compatible server as a Poisson process and/or under a concurrency cap, streamed, and
timed chunk by chunk into :class:`RequestResult` records.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

WORDS = (
    "the of and to in is that it was for on are with as be at by this have from or "
    "one had not but what all were when we there can an your which their said if do "
    "will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me "
    "man too any day same right look think also around another came come work three "
    "word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every "
    "found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both "
    "few those always looked show large often together asked house world going want "
    "school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got "
    "earth need far hand high year mother light parts country father let night"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[dict[str, str]]
    """Text for completions, messages for chat."""
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    start: float
    """Seconds since the benchmark started."""
    end: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of each chunk that brought tokens, seconds since the benchmark started."""
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ------------------------------------------------------------------------------ requests
def _lengths(mean: int, dist: str, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    if dist == "fixed":
        values = np.full(n, mean, dtype=float)
    elif dist == "uniform":
        values = rng.uniform(mean * (1 - ratio), mean * (1 + ratio), n)
    elif dist == "normal":
        values = rng.normal(mean, mean * ratio, n)
    elif dist == "exponential":
        values = rng.exponential(mean, n)
    else:
        raise ValueError(f"unknown length distribution {dist!r}")
    return [max(1, int(round(v))) for v in values]


def synthetic_requests(
    num: int,
    input_len: int,
    output_len: int,
    input_dist: str = "fixed",
    output_dist: str = "fixed",
    range_ratio: float = 0.5,
    seed: int = 0,
    chat: bool = False,
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = _lengths(input_len, input_dist, range_ratio, num, rng)
    outs = _lengths(output_len, output_dist, range_ratio, num, rng)
    out = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        words = [f"{i}:"] + [WORDS[j] for j in rng.integers(0, len(WORDS), max(0, n_in - 1))]
        text = " ".join(words)
        out.append(BenchRequest([{"role": "user", "content": text}] if chat else text, n_out))
    return out


def jsonl_requests(path: str, num: int | None, output_len: int, chat: bool) -> list[BenchRequest]:
    """Lines of ``{"prompt": ...}`` or ``{"messages": [...]}``, with an optional
    ``max_tokens`` / ``output_len``; cycled when ``num`` exceeds the file."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no requests")
    out = []
    for i in range(num or len(rows)):
        row = rows[i % len(rows)]
        max_tokens = int(row.get("max_tokens") or row.get("output_len") or output_len)
        if "messages" in row:
            prompt: str | list[dict[str, str]] = row["messages"]
        else:
            prompt = row["prompt"]
            if chat:
                prompt = [{"role": "user", "content": prompt}]
        out.append(BenchRequest(prompt, max_tokens))
    return out


# ------------------------------------------------------------------------------ client
async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float
) -> RequestResult:
    """Stream one request. Token arrivals are read from the usage every chunk carries
    (``continuous_usage_stats``: a chunk that raised ``completion_tokens`` brought tokens, text
    or not: random-weight models stream empty text); from a server that sends usage only at the
    end, every chunk with text counts as one arrival."""
    result = RequestResult(ok=False, start=time.perf_counter() - t0)
    last: float | None = None
    text_chunks = 0
    tokens_seen = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = str(payload["error"])
                    return result
                now = time.perf_counter() - t0
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                choices = payload.get("choices")
                if not choices:
                    continue
                if usage:
                    arrived = result.output_tokens > tokens_seen
                    tokens_seen = result.output_tokens
                else:
                    arrived = any(
                        c.get("text") or (c.get("delta") or {}).get("content") for c in choices
                    )
                    text_chunks += arrived
                if not arrived:
                    continue
                result.chunk_times.append(now)
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itls.append(now - last)
                last = now
        result.output_tokens = result.output_tokens or text_chunks
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter() - t0
    return result


async def run_requests(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at ``request_rate``, at most ``max_concurrency``
    in flight); return the results in request order and the wall time."""
    url = base_url.rstrip("/") + (
        "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests) or 1
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(req: BenchRequest) -> RequestResult:
            body: dict[str, Any] = {
                "model": model,
                "max_tokens": req.max_tokens,
                "temperature": temperature,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            body["messages" if endpoint == "chat" else "prompt"] = req.prompt
            if ignore_eos:
                body["ignore_eos"] = True
            async with sem:
                return await _one(client, url, body, t0)

        tasks = []
        for req in requests:
            tasks.append(asyncio.ensure_future(fire(req)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
            else:
                # let it go out now: asyncio runs each new task up to its first await before any
                # task resumes, so without this a burst of 256 sent nothing until all 256 had
                # set up their connections (the server idled 0.15-0.6 s meanwhile)
                await asyncio.sleep(0)
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - t0


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]
