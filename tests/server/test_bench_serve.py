"""``roofline bench serve``: its statistics on hand-made results, its request generators, and
end-to-end runs against the session's server (sweep, plots, JSON, chat with a JSONL dataset and
a concurrency cap, and a run whose requests all fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import API_KEY, MODEL, Served, run_in_thread

from roofline.bench.serve import main, summarize, timeline
from roofline.bench.serve_load import RequestResult, jsonl_requests, synthetic_requests
from roofline.engine.async_engine import AsyncLLMEngine
from roofline.entrypoints.openai.server import build_app


def result(start: float, ttft: float, itls: list[float], tokens: int) -> RequestResult:
    chunks = [start + ttft]
    for x in itls:
        chunks.append(chunks[-1] + x)
    return RequestResult(
        ok=True,
        start=start,
        end=chunks[-1],
        ttft=ttft,
        itls=itls,
        chunk_times=chunks,
        output_tokens=tokens,
        prompt_tokens=10,
    )


def test_summary_statistics_and_goodput() -> None:
    fast = result(0.0, 0.1, [0.02] * 4, 5)  # e2e 0.18 s, TPOT 20 ms
    slow = result(0.5, 1.0, [0.2] * 4, 5)  # e2e 1.8 s, TPOT 200 ms
    failed = RequestResult(ok=False, start=0.2, end=0.3, error="HTTP 500: boom")
    s = summarize([fast, slow, failed], duration=2.0, slo_ms={"ttft": 500, "tpot": 50})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(15.0)
    assert s["goodput"] == pytest.approx(0.5)  # only the fast one met both SLOs
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(20 + 0.99 * 180)
    assert s["itl_ms"]["p50"] == pytest.approx(110.0)
    assert s["e2e_ms"]["p90"] == pytest.approx(180 + 0.9 * 1620)
    assert summarize([fast], 1.0)["goodput"] is None  # no SLO given
    assert summarize([failed], 1.0)["ttft_ms"]["p99"] is None


def test_timeline_counts_tokens_and_requests_in_flight() -> None:
    a = result(0.0, 0.5, [0.5], 4)  # two chunks at 0.5 s and 1.0 s, four tokens
    b = result(1.2, 0.3, [], 1)
    tl = timeline([a, b], duration=2.0, bin_s=0.5)
    assert tl["time_s"] == [0.25, 0.75, 1.25, 1.75]
    assert tl["output_tokens_per_s"] == [0.0, 4.0, 4.0, 2.0]
    assert tl["running_requests"] == [1, 1, 1, 0]


def test_request_generators(tmp_path: Path) -> None:
    fixed = synthetic_requests(5, input_len=12, output_len=7, seed=3)
    assert [len(r.prompt.split()) for r in fixed] == [12] * 5
    assert {r.max_tokens for r in fixed} == {7}
    assert len({r.prompt for r in fixed}) == 5
    assert [r.prompt for r in synthetic_requests(5, 12, 7, seed=3)] == [r.prompt for r in fixed]
    uniform = synthetic_requests(200, 100, 50, "uniform", "exponential", 0.5, seed=1)
    assert all(50 <= len(r.prompt.split()) <= 150 for r in uniform)
    assert len({r.max_tokens for r in uniform}) > 20
    chat = synthetic_requests(2, 4, 4, chat=True)
    assert chat[0].prompt[0]["role"] == "user"
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "a b c", "max_tokens": 3}\n\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    rows = jsonl_requests(str(path), 5, output_len=9, chat=False)
    assert [r.max_tokens for r in rows] == [3, 9, 3, 9, 3]
    assert rows[1].prompt == [{"role": "user", "content": "hi"}]
    assert jsonl_requests(str(path), None, 9, chat=True)[0].prompt == [
        {"role": "user", "content": "a b c"}
    ]


def test_bench_sweep_against_server(
    server: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    plots = tmp_path / "plots"
    code = main(
        [
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--input-dist",
            "uniform",
            "--ignore-eos",
            "--sweep-rates",
            "8,inf",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
            "--result-json",
            str(out),
            "--plot-dir",
            str(plots),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "throughput-latency curve" in printed and "TTFT p99" in printed
    data = json.loads(out.read_text())
    assert data["model"] == MODEL
    assert [r["request_rate"] for r in data["runs"]] == [8.0, "inf"]
    for run in data["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 24  # ignore_eos: exactly max_tokens each
        assert run["goodput"] == pytest.approx(run["request_throughput"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert run[key]["p50"] <= run[key]["p90"] <= run[key]["p99"]
        assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert max(run["timeline"]["running_requests"]) >= 1
    names = sorted(p.name for p in plots.iterdir())
    assert names == [
        "latency_rate8.0.png",
        "latency_rateinf.png",
        "sweep.png",
        "timeline_rate8.0.png",
        "timeline_rateinf.png",
    ]
    for p in plots.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_bench_chat_dataset_with_concurrency_cap(server: Served, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}], "max_tokens": 3})
            for q in ("Hi", "Why?", "2+2?")
        )
    )
    out = tmp_path / "r.json"
    code = main(
        [
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--endpoint",
            "chat",
            "--dataset",
            str(data),
            "--num-prompts",
            "5",
            "--max-concurrency",
            "2",
            "--save-requests",
            "--result-json",
            str(out),
        ]
    )
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 5
    assert max(run["timeline"]["running_requests"]) <= 2
    assert all(0 < r["output_tokens"] <= 3 for r in run["requests"])


def test_bench_reports_failures(server: Served, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = main(
        [
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            "wrong",
            "--model",
            MODEL,
            "--num-prompts",
            "3",
            "--output-len",
            "2",
            "--result-json",
            str(out),
        ]
    )
    assert code == 1
    run = json.loads(out.read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (0, 3)
    assert run["errors"] and "401" in run["errors"][0]


def test_bench_times_tokens_of_a_model_without_text(
    tiny_core: AsyncLLMEngine, tmp_path: Path
) -> None:
    """Random weights, no tokenizer: the stream carries no text, the chunks still carry tokens
    (one per step, counted from the usage in every chunk)."""
    data = tmp_path / "ids.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": [5 + i, 6, 7], "max_tokens": 48}) for i in range(3))
    )
    out = tmp_path / "r.json"
    with run_in_thread(build_app(tiny_core)) as url:
        code = main(
            [
                "serve",
                "--base-url",
                url,
                "--dataset",
                str(data),
                "--num-prompts",
                "3",
                "--ignore-eos",
                "--save-requests",
                "--result-json",
                str(out),
            ]
        )
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["completed"], run["total_output_tokens"]) == (3, 144)
    for r in run["requests"]:
        assert r["output_tokens"] == 48 and r["ttft"] is not None
        assert 1 <= len(r["chunk_times"]) <= 48 and len(r["itls"]) == len(r["chunk_times"]) - 1
    assert run["tpot_ms"]["p50"] is not None and run["itl_ms"]["p50"] is not None
