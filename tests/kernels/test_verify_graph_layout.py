"""The verification graphs' padded grid, run eagerly on the CPU (Triton interpreter): the
staging (ragged rows scattered into ``1 + k`` rows per request, padding slots -1, padded
context lengths), the multi-query attention it selects and the sampled rows gathered back give
the same greedy tokens as plain decoding, for a draft that is the target itself (everything
accepted: full grids, and the draft's catch-up rounds of 1..1+k rows) and for n-gram
proposals (short and empty rows beside full ones)."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from roofline.layers.attention import ForwardContext
from roofline.spec_decode.verify_graph import VerifyGraphs
from tests.e2e.hf_reference import tiny_hf_model


class _EagerReplay:
    def __init__(self, graphs: VerifyGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs
        self.calls = 0

    def replay(self) -> None:
        g, n = self.graphs, self.bs * self.graphs.query_len
        ctx = ForwardContext(g._meta(self.bs), g.kv_caches, g.backend)
        g.outputs[self.bs] = g.model(g.input_ids[:n], g.positions[:n], ctx)
        self.calls += 1


class EagerVerifyGraphs(VerifyGraphs):
    """Same buffers and staging; "replay" runs the forward eagerly (no CUDA here)."""

    def capture(self) -> None:
        for bs in self.buckets:
            self.graphs[bs] = _EagerReplay(self, bs)  # type: ignore[assignment]


def _install(runner, query_len: int) -> EagerVerifyGraphs:
    g = EagerVerifyGraphs(
        runner.model, runner.kv_caches, runner.backend, 4, query_len,
        runner.scheduler_config.max_model_len, runner.page_size, runner.device,
    )  # fmt: skip
    g.capture()
    runner.verify_graphs = g
    return g


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_hf_model("llama", path, seed=0, num_hidden_layers=2)
    return str(path)


PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15] * 4, [40, 41, 42, 43, 44, 45, 46]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", attention_backend="triton", max_model_len=64,
          page_size=4)  # fmt: skip


@pytest.fixture(scope="module")
def reference(target):
    outs = LLM(target, **KW).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_grid_path_gives_plain_greedy_tokens(target, reference, method):
    k = 3
    spec = {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 4}
    if method == "draft_model":
        spec["model"] = target
    llm = LLM(target, speculative_config=spec, **KW)
    engine = llm.llm_engine
    graphs = [_install(engine.runner, k + 1)]
    if method == "draft_model":
        graphs.append(_install(engine.spec.proposer.runner, k + 1))
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(sum(r.calls for r in g.graphs.values()) > 0 for g in graphs)
    stats = engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0
    if method == "draft_model":
        assert (
            stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total
        )
