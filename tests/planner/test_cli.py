"""`roofline plan` sub-commands run end to end and print their tables."""

from __future__ import annotations

import json

import pytest

from roofline.planner.calibration import Calibration, CalibrationPoint, save_calibration
from roofline.planner.cli import main


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_kv_literature_line(capsys):
    out = _run(capsys, "kv", "--model", "llama-2-70b", "--kv-dtype", "fp16", "--context", "4096")
    assert "GQA-8" in out and "327,680" in out and "1.342" in out


def test_kv_explicit_dims_and_mla(capsys):
    out = _run(capsys, "kv", "--layers", "61", "--hidden", "7168", "--heads", "128",
               "--intermediate", "18432", "--vocab", "129280", "--mla-kv-lora-rank", "512",
               "--kv-dtype", "bf16")  # fmt: skip
    assert "MLA" in out and "70,272" in out


def test_calculators(capsys, tmp_path):
    assert "H100 SXM" in _run(capsys, "gpus")
    out = _run(capsys, "memory", "--model", "llama-3.1-8b", "--gpu", "h100")
    assert "max sequences at 4096 tokens" in out and "14.96" in out
    out = _run(capsys, "decode", "--model", "llama-3.1-8b", "--gpu", "h100",
               "--batch-sizes", "1,512")  # fmt: skip
    assert "compute-bound from batch" in out and "TTFT" in out
    out = _run(capsys, "parallel", "--model", "llama-2-70b", "--gpu", "h100", "--pp-list", "1,2")
    assert "AR/layer us" in out
    out = _run(capsys, "cost", "--price", "2.5", "--tokens-per-s", "1000")
    assert "$0.694 per million tokens" in out and "continuous" in out
    out = _run(capsys, "specdec", "--alpha", "0.8", "--cost-ratio", "0.05")
    assert "best k = 8" in out and "k = 6..10" in out
    out = _run(capsys, "specdec", "--model", "qwen3-8b", "--draft-model", "qwen3-0.6b",
               "--batch-sizes", "1,64")  # fmt: skip
    assert "verify ms" in out
    # n-gram (no draft): at batch 128 and a short context the 640-row verification is
    # compute-bound and the synchronous step's host time adds to it: speculation loses
    out = _run(capsys, "specdec", "--model", "llama-3.1-8b", "--alpha", "0.5", "--k", "4",
               "--context", "128", "--batch-sizes", "1,128")  # fmt: skip
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert float(rows["1"][-1]) > 1.4 and float(rows["128"][-1]) < 0.8
    out = _run(capsys, "specdec", "--alpha", "0.9", "--cost-ratio", "0", "--verify-cost", "2")
    assert "verification 2 target steps" in out
    # a calibration's step model prices the steps (decode points only: the verification's
    # rows are priced by the same floor + fitted overhead)
    cal = tmp_path / "spec_cal.json"
    points = [CalibrationPoint(b, b * 512, 0, 5e-3 + b * 3e-5) for b in (1, 8, 32, 128, 256)]
    ceil = {"bandwidth_bytes_per_s": 2.9e12, "matmul_flops_per_s": 7.5e14}
    save_calibration(cal, Calibration(points, "test", "llama-3.1-8b", ceilings=ceil))
    out = _run(capsys, "specdec", "--model", "llama-3.1-8b", "--alpha", "0.7", "--k", "4",
               "--calibration", str(cal), "--batch-sizes", "1,128")  # fmt: skip
    assert "calibration" in out and "verify/target" in out


def test_simulate_and_fit(capsys, tmp_path):
    js = tmp_path / "s.json"
    out = _run(capsys, "simulate", "--model", "qwen3-0.6b", "--gpu", "h100", "--num-requests",
               "40", "--rate", "5", "--slo-ttft-ms", "100", "--json", str(js),
               "--plot-dir", str(tmp_path / "plots"))  # fmt: skip
    assert "TTFT p50 / p90 / p99" in out
    assert "token budget 8192" in out  # the engine's CUDA default, not the CPU's 2048
    assert json.loads(js.read_text())["num_requests"] == 40
    pytest.importorskip("matplotlib")
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 1000
    out = _run(capsys, "simulate", "--model", "qwen3-0.6b", "--num-requests", "30",
               "--rates", "1,1000")  # fmt: skip
    assert "rate sweep" in out
    cal = tmp_path / "cal.json"
    points = [CalibrationPoint(b, b * 512, 0, 2e-3 + b * 2e-5) for b in (1, 4, 16, 64)]
    points += [CalibrationPoint(0, 0, q, 2e-3 + q * 1e-5) for q in (128, 512, 2048)]
    save_calibration(cal, Calibration(points, "test", "qwen3-0.6b", {"num_pages": 500}))
    out = _run(capsys, "fit", "--calibration", str(cal), "--model", "qwen3-0.6b")
    assert "per prefill token" in out and "of roofline" in out
    out = _run(capsys, "simulate", "--calibration", str(cal), "--num-requests", "20",
               "--max-model-len", "2048")  # fmt: skip
    assert "500 KV pages" in out


def test_bad_input_is_an_error(capsys):
    assert main(["kv", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_mla_cache_is_priced_or_refused(capsys):
    # DeepSeek-V3's shape: --mla-kv-lora-rank was read by kv and memory only; decode, parallel,
    # cost and simulate priced 128 full KV heads instead of the 576-wide latent
    dims = ["--layers", "61", "--hidden", "7168", "--heads", "128", "--intermediate", "18432",
            "--vocab", "129280", "--gpu", "h200"]  # fmt: skip
    mla = ["--mla-kv-lora-rank", "512"]

    def step_ms(*argv: str) -> float:
        out = _run(capsys, "decode", *dims, "--batch-sizes", "64", "--context", "4096", *argv)
        row = next(line for line in out.splitlines() if line.startswith("64 "))
        return float(row.split()[1])

    mha, latent = step_ms(), step_ms(*mla)
    # 4096 x 64 tokens of KV, 4.0 MB each as 128 full heads, 70 KB as the latent (the 77 GB of
    # bf16 weights stay): 111.2 -> 19.5 ms
    assert latent < mha / 4
    out = _run(capsys, "parallel", *dims, *mla, "--tp-list", "8", "--weight-dtype", "fp8")
    assert "68.6" in out  # KV KiB per token: the latent, replicated on each rank
    cost = _run(capsys, "cost", "--price", "2", *dims, *mla, "--batch", "64", "--tp", "8")
    plain = _run(capsys, "cost", "--price", "2", *dims, "--batch", "64", "--tp", "8")
    assert cost.splitlines()[0] != plain.splitlines()[0]
    sim = ["simulate", *dims, "--tp", "8", "--weight-dtype", "fp8", "--num-requests", "8"]
    assert "KV pages" in _run(capsys, *sim, *mla)
    for argv in (["specdec", "--model", "llama-3.1-8b", *mla], ["fit", "--calibration", "x", *mla]):
        assert main(argv) == 2
        assert "--mla-kv-lora-rank is not supported" in capsys.readouterr().err
