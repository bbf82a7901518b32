"""The quantized gate_up GEMM with the SiLU-and-mul in its epilogue (``wo_gemm_ws`` with
``silu_mul``): which layers and row counts take it (``common.silu_out_choice``), and that an MLP
whose gate_up method takes it computes what the unfused pair does. The kernel itself runs only on
a Hopper GPU (``scripts/gpu_wonly.py --silu`` checks it against the unfused pair there); its
sm_90 build is checked for spills and register races in ``tests/kernels/test_wo_gemm.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roofline.kernels import wo_gemm
from roofline.layers.linear import MergedLinear
from roofline.quantization import common
from roofline.quantization.fp8 import Fp8LinearMethod
from roofline.quantization.int8 import Int8LinearMethod

N, K = 28672, 4096  # Llama-3.1-8B's merged gate_up: table entries at every bucket


def _fake_x(rows: int, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """What ``silu_out_choice`` reads of x: a CUDA tensor's shape and dtype (no GPU here)."""
    return SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(rows, K), dtype=dtype)


def _layer(symmetric: bool = False, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    return SimpleNamespace(
        qweight=torch.empty(N, K, dtype=torch.int8),
        scales=torch.empty(N, dtype=dtype),
        offsets=None,
        int4_symmetric=symmetric,
    )


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(wo_gemm, "supports", lambda *a: True)  # every call fits a Hopper GPU


def test_choice_follows_the_table_pick(hopper, monkeypatch) -> None:
    want = wo_gemm.pick("int8", 256, N, K)
    assert want is not None and want.ws == 1  # the shipped table: warp-specialized at 256
    assert common.silu_out_choice("int8", _layer(), _fake_x(256)) == (want, None)
    # another form at the bucket (stream-K at 512 rows): the unfused pair
    assert wo_gemm.pick("int8", 512, N, K).ws == 2
    assert common.silu_out_choice("int8", _layer(), _fake_x(512)) is None
    # decode rows (the GEMV kernels), a shape without entries, CPU tensors, the switch off
    assert common.silu_out_choice("int8", _layer(), _fake_x(common.DECODE_MAX_ROWS)) is None
    odd = SimpleNamespace(**{**vars(_layer()), "qweight": torch.empty(1000, K, dtype=torch.int8)})
    assert common.silu_out_choice("int8", odd, _fake_x(256)) is None
    assert common.silu_out_choice("int8", _layer(), torch.empty(256, K)) is None
    monkeypatch.setattr(common, "USE_WO_SILU", False)
    assert common.silu_out_choice("int8", _layer(), _fake_x(256)) is None


def test_silu_table_entries_come_first(hopper, monkeypatch) -> None:
    """A ``WO_SILU_CONFIGS`` entry takes the epilogue where ``WO_CONFIGS`` has none (the layer
    would run mixed_gemm) or another form; the entries are all the warp-specialized form."""
    assert all(wo_gemm.WoConfig(*c).ws == 1 for c in wo_gemm.WO_SILU_CONFIGS.values())
    monkeypatch.setitem(wo_gemm.WO_SILU_CONFIGS, ("int8", N, K, 4096), (256, 128, 64, 1, 3, 8, 1))
    assert wo_gemm.pick("int8", 4096, N, K) is None
    got = common.silu_out_choice("int8", _layer(), _fake_x(3000))  # bucket 4096
    assert got == (wo_gemm.WoConfig(256, 128, 64, 1, 3, 8, 1), None)


def test_symmetric_int4_takes_its_own_entries(hopper) -> None:
    cfg = wo_gemm.pick("int4s", 256, N, K)
    got = common.silu_out_choice("int4", _layer(symmetric=True), _fake_x(256))
    assert got == (cfg, None)  # offsets left out: the kernel's symmetric form
    asym = SimpleNamespace(**{**vars(_layer()), "offsets": torch.empty(N, K // 128)})
    got = common.silu_out_choice("int4", asym, _fake_x(256))
    assert got is not None and got[0] == wo_gemm.pick("int4", 256, N, K)
    assert got[1] is asym.offsets
    # the symmetric form takes scales of x's dtype only: fp16 scales with fp16 x (a GPTQ
    # checkpoint run in fp16), not with bf16 x (its own kind's entries, offsets passed)
    fp16 = _layer(symmetric=True, dtype=torch.float16)
    assert common.silu_out_choice("int4", fp16, _fake_x(256, torch.float16)) == (cfg, None)
    assert common.silu_out_choice("int4", fp16, _fake_x(256))[1] is fp16.offsets


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class _Recording(Int8LinearMethod):
    """int8 whose gate_up claims the SiLU epilogue and computes it as the unfused pair (the
    torch dequantize path), recording the calls: the MLP's wiring on the CPU."""

    calls = 0

    def fuses_silu_mul_out(self, layer, x) -> bool:
        return x.shape[0] > 1

    def apply_silu_mul_out(self, layer, x, bias):
        type(self).calls += 1
        return _silu_and_mul(self.apply(layer, x, bias))


def test_mlp_runs_the_method_epilogue_and_matches_the_pair(monkeypatch) -> None:
    from roofline.models.llama import LlamaMLP

    monkeypatch.setattr(common, "USE_CPU_KERNELS", False)
    hidden, inter = 64, 96
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=False)
    torch.manual_seed(0)
    mlp = LlamaMLP(cfg, quant_config=None, prefix="mlp")
    for method, layer in ((_Recording(), "gate_up_proj"), (Int8LinearMethod(), "down_proj")):
        lin = getattr(mlp, layer)
        fresh = MergedLinear(lin.in_features, lin.output_sizes, method=method)
        for shard, size in enumerate(lin.output_sizes):
            fresh.load(shard, "weight", torch.randn(size, lin.in_features) * 0.1)
        fresh.process_weights_after_loading()
        setattr(mlp, layer, fresh)
    x = torch.randn(5, hidden)
    got = mlp(x)
    assert _Recording.calls == 1
    want = mlp.down_proj(_silu_and_mul(mlp.gate_up_proj(x)))
    torch.testing.assert_close(got, want)
    mlp(x[:1])  # one row: the method declines, the pair runs
    assert _Recording.calls == 1


def test_w8a8_never_takes_it(hopper, monkeypatch) -> None:
    monkeypatch.setattr(common, "silu_out_choice", lambda *a: ("cfg", None))
    x = _fake_x(256)
    assert Fp8LinearMethod(w8a8=False).fuses_silu_mul_out(_layer(), x)
    assert not Fp8LinearMethod(w8a8=True).fuses_silu_mul_out(_layer(), x)
