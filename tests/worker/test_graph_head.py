"""Which steps may take the decode graph's own greedy ids (``worker/graph_head.py``), and where
the head is captured at all (CUDA, 16-bit skinny GEMM shapes only)."""

from __future__ import annotations

import torch

from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.graph_head import capture_head, full_head, greedy_ids_suffice


def _req(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params))


def test_only_plain_greedy_rows_without_logprobs_take_the_ids() -> None:
    assert greedy_ids_suffice([_req(temperature=0.0), _req(temperature=0.0, max_tokens=3)])
    assert not greedy_ids_suffice([_req(temperature=0.0), _req(temperature=0.7)])
    assert not greedy_ids_suffice([_req(temperature=0.0, logprobs=2)])
    assert not greedy_ids_suffice([_req(temperature=0.0, repetition_penalty=1.2)])
    assert not greedy_ids_suffice([_req(temperature=0.0, presence_penalty=0.5)])
    assert not greedy_ids_suffice([_req(temperature=0.0, frequency_penalty=0.5)])
    assert not greedy_ids_suffice([_req(temperature=0.0, min_tokens=4)])  # EOS still banned
    reached = _req(temperature=0.0, min_tokens=1)  # min_tokens reached: plain greedy again
    reached.output_token_ids.append(5)
    assert not reached.argmax_only and greedy_ids_suffice([_req(temperature=0.0), reached])


def test_no_head_off_cuda() -> None:
    hidden = torch.zeros(1, 8)
    assert capture_head(torch.nn.Linear(8, 8), hidden) is None
    assert full_head(torch.nn.Linear(8, 8), hidden) is None
