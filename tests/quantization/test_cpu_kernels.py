"""The compiled CPU kernels wired to ``common.register_cpu_kernel``: int8/int4 layers on the CPU
run ``kernels.cpu.ops.canonical_gemm`` (registered on the first CPU call), close to the
dequantize-then-matmul reference for every scale layout; layers the kernel cannot take fall back;
SmolLM2's real weights requantized to int4 generate the reference path's greedy tokens and
prompt log-probabilities."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.kernels.cpu.build import load_library
from roofline.quantization import common, cpu_kernels, formats

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler for the kernels")


def _reference(kind: str, x, q, scales, offsets, bias):
    common_x = x.float()
    if kind == "int8":
        w = formats.dequantize_int8(q, scales, torch.float32)
    else:
        w = formats.dequantize_int4(q, scales, offsets, torch.float32)
    out = common_x @ w.T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize(
    "kind,group,dtype",
    [
        ("int8", None, torch.float32),
        ("int8", 32, torch.bfloat16),
        ("int4", 32, torch.float32),
        ("int4", 64, torch.bfloat16),
        ("int4", 128, torch.float16),
    ],
)
def test_registered_kernel_matches_reference(kind: str, group: int | None, dtype) -> None:
    assert cpu_kernels.install()
    assert {"int8", "int4"} <= set(common.CPU_KERNELS)
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 256
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(5, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    scale_dtype = torch.float32 if dtype == torch.float32 else dtype
    if kind == "int8":
        qw = formats.quantize_int8(w, group or k, scale_dtype)
        q, scales, offsets = qw.qweight, qw.scales, None
    else:
        q, scales, offsets = formats.quantize_int4(w, group, group != 64, scale_dtype)
    got = common.CPU_KERNELS[kind](x, q, scales, offsets, bias)
    assert got.dtype == dtype and got.shape == (5, n)
    want = _reference(kind, x, q, scales, offsets, bias)
    rel = (got.float() - want).norm() / want.norm()
    assert float(rel) < (1e-4 if dtype == torch.float32 else 1e-2)


def test_groups_the_kernel_cannot_take_fall_back() -> None:
    assert cpu_kernels.install()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 48, generator=gen)  # K = 48: not a multiple of the kernel's block
    qw = formats.quantize_int8(w, 16, torch.float32)
    x = torch.randn(3, 48, generator=gen)
    got = common.CPU_KERNELS["int8"](x, qw.qweight, qw.scales, None, None)
    want = _reference("int8", x, qw.qweight, qw.scales, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_smollm2_int4_kernel_path_matches_reference_path(monkeypatch) -> None:
    llm = LLM(device="cpu", quantization="int4-g64", max_model_len=128)
    # the reference path dequantizes every weight per step: a few steps only
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    prompts = ["The capital of France is the city of", "def fibonacci(n):"]

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, [o.outputs[0].token_ids for o in outs]

    calls = []
    kernel = common.CPU_KERNELS.get("int4")
    if kernel is None:
        assert cpu_kernels.install()
        kernel = common.CPU_KERNELS["int4"]
    monkeypatch.setitem(common.CPU_KERNELS, "int4", lambda *a: calls.append(1) or kernel(*a))
    fast, fast_tokens = run()
    assert calls  # the compiled kernel ran
    monkeypatch.setattr(common, "USE_CPU_KERNELS", False)
    ref, ref_tokens = run()
    assert fast_tokens == ref_tokens
    for a, b in zip(fast, ref, strict=True):
        for da, db in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            (tok, lp_a), (_, lp_b) = next(iter(da.items())), next(iter(db.items()))
            assert abs(lp_a.logprob - db[tok].logprob) < 2e-2, (lp_a, lp_b)
