"""`roofline bench latency` and `bench throughput` on a tiny random model on the CPU: their
tables, the roofline percentages, and the calibration file that `roofline plan fit` reads."""

from __future__ import annotations

import json

from roofline.entrypoints.cli import main
from roofline.planner.calibration import fit_calibration, load_calibration


def _tiny_config(tmp_path) -> str:
    cfg = json.load(open("roofline/model_configs/qwen3-0.6b/config.json"))
    cfg.update(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_bench_latency_writes_calibration(tmp_path, capsys):
    model = _tiny_config(tmp_path)
    cal_path, json_path = tmp_path / "cal.json", tmp_path / "lat.json"
    rc = main(
        [
            "bench",
            "latency",
            "--model",
            model,
            "--batch-sizes",
            "1,4",
            "--input-len",
            "24",
            "--output-len",
            "12",
            "--max-model-len",
            "256",
            "--json",
            str(json_path),
            "--calibration-out",
            str(cal_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "% roofline" in out and "calibration points written" in out
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(r["step_ms_p50"] > 0 and 0 < r["roofline_pct"] for r in rows)
    cal = load_calibration(cal_path)
    # every step of both batches (prefill and decode) was recorded with its shape
    assert len(cal.points) >= 2 * 12 - 2
    assert {p.num_decode_tokens for p in cal.points} >= {1, 4}
    assert any(p.num_prefill_chunks == 4 for p in cal.points)  # the batch-4 prefill step
    fit_calibration(cal.points)  # the planner can fit a step-time model from it
    rc = main(["plan", "fit", "--calibration", str(cal_path)])
    assert rc == 0


def test_bench_throughput_reports_roofline(tmp_path, capsys):
    model = _tiny_config(tmp_path)
    rc = main(
        [
            "bench",
            "throughput",
            "--model",
            model,
            "--num-prompts",
            "6",
            "--input-len",
            "8:32",
            "--output-len",
            "4:8",
            "--max-model-len",
            "256",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "of the workload roofline" in out and "output tok/s" in out


def test_bench_calibrate_then_plan_validate(tmp_path, capsys):
    """The designed sweep writes a version 2 calibration (ceilings, model, build, every kind of
    step), and `plan validate` predicts its suite from it and compares with the engine."""
    model = _tiny_config(tmp_path)
    cal_path, out_path = tmp_path / "cal.json", tmp_path / "val.json"
    engine_flags = ["--model", model, "--max-model-len", "128", "--max-num-seqs", "8"]
    engine_flags += ["--max-num-batched-tokens", "64"]
    rc = main(["bench", "calibrate", *engine_flags, "--calibration-out", str(cal_path),
               "--time-budget", "60"])  # fmt: skip
    assert rc == 0
    cal = load_calibration(cal_path)
    assert cal.ceilings and cal.ceilings["bandwidth_bytes_per_s"] > 0
    assert cal.model_config["hidden_size"] == 64 and cal.build["roofline"]
    shapes = [p.shape() for p in cal.points]
    assert max(s.num_decode_tokens for s in shapes) == 8  # the largest batch the engine allows
    assert any(s.num_decode_tokens and s.prefill_chunks for s in shapes)  # mixed steps
    assert any(p > 0 for s in shapes for _, p in s.prefill_chunks)  # chunks over a cached prefix
    assert any(s.decode_shared_tokens for s in shapes)  # decodes over a shared prefix
    assert "fit above the roofline floor" in capsys.readouterr().out
    rc = main(["plan", "validate", *engine_flags, "--calibration", str(cal_path),
               "--scale", "0.01", "--out", str(out_path)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "figures outside their target" in out
    rows = json.loads(out_path.read_text())["rows"]
    assert [r["workload"].split(" (")[0] for r in rows] == [
        "short requests",
        "long prompts",
        "long outputs",
        "shared prefix",
        "mixed 100-1024 / 512",
        "serving at 80% of saturation",
    ]
    for row in rows:
        for key in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
            assert row[key]["measured"] > 0 and row[key]["simulated"] > 0


def test_precision_of_prices_the_kv_cache_as_stored():
    # a calibration's floor counts the KV bytes the engine really moves: with fp8 / int8 pages
    # it was priced at the model dtype (twice the bytes, scales aside)
    from types import SimpleNamespace

    import torch

    from roofline.bench.latency import precision_of
    from roofline.quantization.kv_cache import KVCacheSpec

    for kv_cache_dtype, want in (("auto", "bf16"), ("fp8", "fp8"), ("int8", "int8")):
        spec = KVCacheSpec.create(kv_cache_dtype, torch.bfloat16)
        runner = SimpleNamespace(dtype=torch.bfloat16, kv_spec=spec, quant_config=None)
        precision = precision_of(SimpleNamespace(runner=runner))
        assert (precision.weight_dtype, precision.kv_dtype) == ("bf16", want)
    half = KVCacheSpec.create("auto", torch.float32).with_half_pages()  # the CPU decoder's pages
    runner = SimpleNamespace(dtype=torch.float32, kv_spec=half, quant_config=None)
    assert precision_of(SimpleNamespace(runner=runner)).kv_dtype == "fp16"
