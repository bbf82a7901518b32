"""Helpers for the server tests: a ``roofline serve`` subprocess on a free loopback port, an
in-process uvicorn runner, ``/metrics`` parsing, and the OpenAI error-shape assertion."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from roofline.engine.async_engine import AsyncLLMEngine

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 1 << 20
MAX_TOKENS = 16
"""Greedy length of the reference answers."""
SUBJECTS = ["the sea", "a cat", "winter", "coffee", "the moon", "trains", "music", "bread"]
STYLES = [
    "A fact about",
    "A short poem about",
    "Why I like",
    "The history of",
    "A question about",
    "My memory of",
    "A list of things about",
    "The future of",
]
PROMPTS = [f"{style} {subject}:" for style in STYLES for subject in SUBJECTS]
"""64 distinct prompts, one per concurrent client."""
CHATS = [[{"role": "user", "content": f"Tell me about {s}."}] for s in SUBJECTS[:4]]
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    """The session's server: its base URL and the engine behind it."""

    base_url: str
    engine: AsyncLLMEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m roofline.entrypoints.openai.cli serve`` on a free loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "roofline.entrypoints.openai.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def log_tail(self, n: int = 4000) -> str:
        return Path(self.log.name).read_text()[-n:]

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.unlink(self.log.name)


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name with sorted labels but model_name: value}``."""
    headers = {"Authorization": f"Bearer {API_KEY}"}  # ignored by servers without a key
    text = httpx.get(f"{base_url}/metrics", timeout=30, headers=headers).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll ``/metrics`` until nothing runs, waits or holds KV pages; return the last read."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        idle = (
            m["roofline:num_requests_running"] == 0
            and m["roofline:num_requests_waiting"] == 0
            and m["roofline:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


TINY_KV_BYTES = 4 << 20
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


@contextmanager
def run_in_thread(app: object) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a loopback port in a thread; yield its base URL."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


# Fault injection: ``core_setup`` hooks, run in the engine core (a child process) on its engine.
def slow_steps(engine: Any) -> None:
    """Every step takes at least 50 ms more (keeps requests running while a test acts)."""
    real_step = engine.step

    def step() -> Any:
        time.sleep(0.05)
        return real_step()

    engine.step = step


def fail_fifth_step(engine: Any) -> None:
    """The 5th step raises."""
    real_step = engine.step
    calls = [0]

    def step() -> Any:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = step


def crash_add_of_crash(engine: Any) -> None:
    """Adding a request whose id is ``crash`` raises a TypeError (an engine bug, not bad input)."""
    real_add = engine.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        if request_id == "crash":
            raise TypeError("injected add failure")
        real_add(request_id, *args, **kwargs)

    engine.add_request = add_request


def child_pids(pid: int) -> list[int]:
    """The live children of process ``pid`` (Linux)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
