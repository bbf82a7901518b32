"""Quality bounds on the real SmolLM2 weights (CPU): perplexity of the shipped essay's first
384 tokens and teacher-forced top-1 agreement with the unquantized engine, per configuration.
Loose bounds (the measured figures are in BENCHMARKS.md); a new quantization method is one more
line in ``CONFIGS``."""

from __future__ import annotations

import pytest

from roofline.bench.quality import format_table, load_text, measure, parse_config

NUM_TOKENS = 384

CONFIGS = {  # name: (LLM kwargs, max perplexity increase over "auto", min top-1 agreement)
    "fp8-kv": ({"kv_cache_dtype": "fp8"}, 0.03, 0.92),
    "int8-kv": ({"kv_cache_dtype": "int8"}, 0.02, 0.94),
}


@pytest.fixture(scope="module")
def results():
    configs = {"auto": {}, **{name: kw for name, (kw, _, _) in CONFIGS.items()}}
    out = {r.name: r for r in measure(configs, num_tokens=NUM_TOKENS)}
    print(format_table(list(out.values())))
    return out


def test_reference_perplexity_is_plausible(results):
    ref = results["auto"]
    assert ref.num_tokens == NUM_TOKENS - 1 and ref.agreement is None
    assert 5.0 < ref.perplexity < 120.0  # SmolLM2-135M on plain English prose


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quality_bounds(results, name):
    _, max_ppl_increase, min_agreement = CONFIGS[name]
    r, ref = results[name], results["auto"]
    assert r.perplexity <= ref.perplexity * (1 + max_ppl_increase), (r, ref)
    assert r.agreement is not None and r.agreement >= min_agreement, r


def test_text_and_config_parsing():
    assert len(load_text().split()) > 2000
    assert parse_config('fp8={"kv_cache_dtype": "fp8"}') == ("fp8", {"kv_cache_dtype": "fp8"})
    assert parse_config("auto") == ("auto", {})
    with pytest.raises(ValueError):
        parse_config("x=[1]")
