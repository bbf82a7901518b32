"""The start-up warm-up compiles every Triton kernel variant a prefill or mixed step can launch.

On the H100 a process's first run of the default preset compiled ``_prefill_tma_kernel`` twice
in the middle of serving (prefill steps 10.8 s instead of 3.3 s): every warm-up batch was "mostly
short chunks", which the GQA-packed kernel takes, so the descriptor kernel the long chunks need
(fresh, and over a gathered prefix) never ran at start-up. Here the engine's own warm-up batches
(``worker/warmup.py``) run through a tiny GQA Llama with the Triton backend, the launches
recorded with the key a compiled kernel's cache would look them up by (``specialization_keys``:
argument specialisations, constexprs, options; launches skipped), the launchers choosing the
GPU's tiles; then steps of odd shapes (ragged chunks over odd cached prefixes, odd decode
counts, long and short chunks, decode-first as the split path lays them out and in arrival
order) must find every key among the warm-up's.
"""

from __future__ import annotations

import random

import pytest
from specialization_keys import LaunchKey, recording

from roofline.worker.warmup import long_chunk_len, warmup_batches
from tests.e2e.hf_reference import tiny_hf_model

MAX_LEN = 1024
PAGE = 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm_keys")
    tiny_hf_model("llama", path, num_hidden_layers=1, head_dim=128, hidden_size=256,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=MAX_LEN)  # fmt: skip
    return path


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The launchers pick the GPU's tiles (the interpreter's small ones would hide the tile
    choice, which selects a compiled variant); nothing is launched."""
    from roofline.kernels import prefill_attention, prefill_attention_gqa

    for module in (prefill_attention, prefill_attention_gqa):
        monkeypatch.setattr(module, "is_interpret", lambda: False)


def _runner(path, mode: str, kv_cache_dtype: str = "auto"):
    from roofline import LLM

    llm = LLM(str(path), dtype="bfloat16", device="cpu", attention_backend="triton",
              cuda_graph_mode=mode, max_model_len=MAX_LEN, page_size=PAGE,
              max_num_batched_tokens=MAX_LEN, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return llm.llm_engine.runner


def _keys(runner, batches) -> list[LaunchKey]:
    with recording() as keys:
        for batch in batches:
            runner._warmup_forward(batch)
    return keys


def _odd_batches(seed: int, split: bool, n: int) -> list[list[tuple[int, int]]]:
    """Steps as serving makes them: odd decode counts, ragged chunks over odd prefixes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        decodes = [(rng.randrange(1, MAX_LEN - 1), 1) for _ in range(rng.choice((0, 1, 3, 5, 6)))]
        chunks = []
        for _ in range(rng.randrange(1, 4)):
            new = rng.choice((rng.randrange(2, 130), rng.randrange(130, 257),
                              rng.randrange(257, 600)))  # fmt: skip
            cached = rng.choice((0, rng.randrange(1, 200)))
            chunks.append((cached, new))
        if i % 4 == 0:  # one long chunk alone (a long prompt's step)
            cached = rng.choice((0, rng.randrange(1, 300)))
            decodes, chunks = [], [(cached, rng.randrange(257, 700))]
        batch = decodes + chunks if split else rng.sample(decodes + chunks, len(decodes + chunks))
        if not any(new > 1 for _, new in batch):
            batch.append((0, 5))
        out.append(batch)
    return out


@pytest.mark.parametrize(
    "mode,tiles,kv_cache_dtype",
    [("full", None, "auto"), ("full_decode_only", None, "auto"),
     ("full", (128, 64, 4, 2), "auto"), ("full", None, "fp8")],
    ids=["split", "in-order", "split-tiles-override", "split-fp8-cache"],
)  # fmt: skip
def test_odd_steps_find_every_kernel_variant_compiled_by_the_warmup(
    tiny_path, gpu_tiles, mode, tiles, kv_cache_dtype, monkeypatch
):
    from roofline.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "TMA_TILES", tiles)
    runner = _runner(tiny_path, mode, kv_cache_dtype)
    split = runner.mixed is not None
    assert split == (mode == "full")
    limit = min(runner.num_pages * PAGE, MAX_LEN)
    batches = warmup_batches(32, limit, PAGE, runner.num_pages, split)
    assert any(new == long_chunk_len() for b in batches for _, new in b)
    warm = set(_keys(runner, batches))
    # the descriptor kernel takes long chunks; over a quantized cache only fresh steps' (their
    # rows read back dequantized: triton_backend.fresh_rows_dequantized)
    assert any(k.kernel == "_prefill_tma_kernel" for k in warm)
    missing: dict[LaunchKey, list] = {}
    for batch in _odd_batches(7 if split else 8, split, 40):
        for key in _keys(runner, [batch]):
            if key not in warm:
                missing.setdefault(key, batch)
    report = "\n".join(f"{k.diff(warm)}\n    first in {b}" for k, b in missing.items())
    assert not missing, "variants the warm-up did not compile:\n" + report


def test_the_warmup_before_long_chunks_missed_the_descriptor_kernel(tiny_path, gpu_tiles):
    """The check above can fail: the warm-up's short batches alone (what it ran before) leave
    the descriptor kernel's variants for the first long prompt."""
    runner = _runner(tiny_path, "full")
    short = [b for b in warmup_batches(32, MAX_LEN, PAGE, runner.num_pages, True)
             if all(new < long_chunk_len() for _, new in b)]  # fmt: skip
    warm = set(_keys(runner, short))
    long_step = _keys(runner, [[(3, 1), (0, 400)], [(0, 300), (77, 290)]])
    assert {k.kernel for k in long_step if k not in warm} == {"_prefill_tma_kernel"}
