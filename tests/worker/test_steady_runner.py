"""The runner's steady decode path end to end on the CPU: the decode graphs and the advance
graphs replaced by eager stand-ins over the same static buffers (``EagerGraphs`` runs the model
on what the buffers hold, ``EagerSteady`` advances them with ``advance_inputs``), so every step
the runner stages, advances or rebuilds is read back from those buffers. Async greedy tokens
must equal the plain CPU engine's (no graphs), and steady steps must have run."""

from __future__ import annotations

import random

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.attention.metadata import AttentionMetadata
from roofline.layers.attention import ForwardContext
from roofline.worker.cuda_graph import DecodeGraphs
from roofline.worker.model_runner import ModelRunner
from roofline.worker.steady_inputs import SteadyInputs
from tests.e2e.hf_reference import tiny_hf_model


class EagerGraphs(DecodeGraphs):
    def capture(self, pool=None) -> None:
        for bs in self.buckets:
            self.graphs[bs] = None  # type: ignore[assignment]

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        lens = self.seq_lens[:n]
        meta = AttentionMetadata(
            num_reqs=n, num_tokens=n, query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=lens, block_table=self.block_table[:n], slot_mapping=self.slot_mapping[:n],
            max_query_len=1, max_seq_len=int(lens.max()), page_size=self.page_size,
            query_start_loc_cpu=list(range(n + 1)), query_lens_cpu=[1] * n,
            seq_lens_cpu=lens.tolist(),
        )  # fmt: skip
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        return self.model(self.input_ids[:n], self.positions[:n], ctx)


class EagerSteady(SteadyInputs):
    def capture(self, pool=None) -> None:
        self._graphs = dict.fromkeys(self.graphs.buckets)  # type: ignore[arg-type]
        self._table_ptr = self.block_tables.table.data_ptr()

    def advance(self, bucket: int, sampled: torch.Tensor, flat: list[int], pages: list[int]):
        packed = torch.tensor([len(flat), *flat, *pages])
        self.updates[: packed.shape[0]].copy_(packed)
        self.graphs.input_ids[: sampled.shape[0]].copy_(sampled)
        self._advance(bucket)


def _install(llm: LLM) -> dict[str, int]:
    runner = llm.llm_engine.runner
    sc = runner.scheduler_config
    runner.graphs = EagerGraphs(runner.model, runner.kv_caches, runner.backend, sc.max_num_seqs,
                                sc.max_model_len, runner.page_size, runner.device)  # fmt: skip
    runner.graphs.capture()
    runner.steady_inputs = EagerSteady(runner.graphs, runner.block_tables, runner.page_size)
    runner.steady_inputs.capture()
    counts = {"advanced": 0}
    advance = runner._advance_staged

    def counted(*args):
        counts["advanced"] += 1
        return advance(*args)

    runner._advance_staged = counted  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("page_size", [4, 16])
def test_steady_device_path_gives_the_same_tokens(tmp_path, page_size: int) -> None:
    tiny_hf_model("llama", tmp_path)
    rng = random.Random(page_size)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 33, 60, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (40, 40, 40, 25, 40, 33)]  # fmt: skip
    runs = []
    for graphs in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", async_scheduling=True,
                  page_size=page_size)  # fmt: skip
        counts = _install(llm) if graphs else None
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    assert counts is not None and counts["advanced"] >= 30
    assert isinstance(llm.llm_engine.runner, ModelRunner)
