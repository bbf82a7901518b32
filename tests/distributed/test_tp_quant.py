"""Quantized layers under tensor parallelism on the CPU (gloo, ``mp`` workers): a tiny random
Llama generates at TP = 2 the greedy tokens it generates at TP = 1 when quantized on the fly to
int4 (each rank quantizes whole groups of its own slices, exactly as TP = 1 does) and when
On-the-fly per-channel int8/fp8 quantize each rank's K slice of a row-parallel layer with that
slice's own row scales, and W8A8 (fp8 checkpoints) scales each rank's activation slice on its
own (as vLLM does): they run at TP = 2 but are not bit-identical to TP = 1. A group that a rank's
slice would cut is refused before any worker starts."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from roofline import LLM, SamplingParams
from roofline.quantization import formats
from tests.e2e.hf_reference import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 2, [20, 21, 22], [100 + i for i in range(20)]]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, num_pages=32, page_size=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-quant")
    tiny_hf_model("llama", path, num_hidden_layers=2, intermediate_size=128)
    return path


def _tokens(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["int4-g32", "int4-asym-g32"])
def test_int4_tp2_matches_tp1(tiny, method: str) -> None:
    expected = _tokens(tiny, quantization=method)
    assert _tokens(tiny, quantization=method, tensor_parallel_size=2) == expected


def test_fp8_checkpoint_loads_sliced_at_tp2(tiny, tmp_path) -> None:
    """fp8 checkpoints run W8A8 (per-token activation scales over each rank's K slice of a
    row-parallel layer, so not bit-identical to TP = 1): loads, slices and generates."""
    for file in tiny.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for file in tiny.glob("*.safetensors"):
        for name, t in load_file(str(file)).items():
            if ".layers." in name and name.endswith("proj.weight"):
                q, scales = formats.quantize_fp8(t.float())
                tensors[name] = q
                tensors[name.replace(".weight", ".weight_scale")] = scales.reshape(-1, 1)
            else:
                tensors[name] = t
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = _tokens(tmp_path, tensor_parallel_size=2)
    assert [len(t) for t in got] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_channel_on_the_fly_runs_quantized_at_tp2(tiny, method: str) -> None:
    got = _tokens(tiny, quantization=method, tensor_parallel_size=2)
    assert [len(t) for t in got] == [GREEDY.max_tokens] * len(PROMPTS)
    assert got[1][:2] == _tokens(tiny, quantization=method)[1][:2]  # clear margins early on


def test_group_cut_by_a_rank_is_refused_before_workers_start(tmp_path) -> None:
    tiny_hf_model("llama", tmp_path, num_hidden_layers=1)  # intermediate 160: 80 per rank
    with pytest.raises(ValueError, match="groups of 32 do not"):
        LLM(str(tmp_path), **ENGINE, quantization="int4-g32", tensor_parallel_size=2)
