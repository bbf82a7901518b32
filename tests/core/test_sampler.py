"""Sampler: greedy and truncation rules, the sampled distribution, seeded reproducibility
inside arbitrary batches, exact penalty values, min_tokens masking and raw-logit logprobs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from roofline.layers.sampler import Sampler
from roofline.request import Request
from roofline.sampling_params import SamplingParams

_ids = itertools.count()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _req(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    request_id: str | None = None,
    **params: object,
) -> Request:
    return Request(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=prompt or [0],
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=eos,
        output_token_ids=list(output or []),
    )


def _logits(num_rows: int, vocab_size: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab_size, generator=g) * 3).to(device)  # [R, V]


def test_greedy_is_argmax(device: torch.device) -> None:
    logits = _logits(8, 50, device)
    out = Sampler().sample(logits, [_req(temperature=0.0) for _ in range(8)])
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (8,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_logits_same_tokens_as_their_float32_cast(
    dtype: torch.dtype, device: torch.device
) -> None:
    """The runner hands greedy steps the head's 16-bit logits: plain greedy rows take their
    argmax as given, ties (common after rounding) included; rows with logprobs, penalties or
    temperature see the float32 cast, as before."""
    vocab = 8192 * 2  # large enough for the chunked argmax path on CUDA
    logits = (_logits(6, vocab, device, seed=4) * 0.25).to(dtype)  # [R, V]: many ties
    logits[1, 100] = logits[1, 9000] = logits[1].max() + 1  # an exact tie: lowest index wins
    greedy = [_req(temperature=0.0) for _ in range(6)]
    out = Sampler().sample(logits, greedy)
    ref = Sampler().sample(logits.float(), greedy)
    assert torch.equal(out.token_ids, ref.token_ids) and out.token_ids[1].item() == 100
    mixed = [_req(temperature=0.0, logprobs=2)] + [_req(temperature=0.0) for _ in range(5)]
    out, ref = Sampler().sample(logits, mixed), Sampler().sample(logits.float(), mixed)
    assert torch.equal(out.token_ids, ref.token_ids) and out.logprobs == ref.logprobs
    pen = [_req(temperature=0.0, repetition_penalty=1.3, output=[5, 9000])] * 6
    out, ref = Sampler().sample(logits, pen), Sampler().sample(logits.float(), pen)
    assert torch.equal(out.token_ids, ref.token_ids)


def test_tiny_temperature_is_greedy(device: torch.device) -> None:
    logits = _logits(8, 50, device, seed=1)
    out = Sampler().sample(logits, [_req(temperature=1e-7) for _ in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_truncation_to_one_token_is_greedy(params: dict[str, float], device: torch.device) -> None:
    torch.manual_seed(0)
    logits = _logits(64, 100, device, seed=2)
    requests = [_req(temperature=1.5, **params) for _ in range(64)]
    out = Sampler().sample(logits, requests)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_keeps_k_tokens(device: torch.device) -> None:
    logits = _logits(4, 30, device, seed=3)
    requests = [_req(top_k=k) for k in (1, 5, 0, 29)]
    processed = Sampler().process_logits(logits, requests)
    assert torch.isfinite(processed).sum(-1).tolist() == [1, 5, 30, 29]
    kept = torch.isfinite(processed[1])
    assert torch.equal(
        kept.nonzero().flatten().sort().values, logits[1].topk(5).indices.sort().values
    )


def test_top_k_same_with_or_without_top_p_rows(device: torch.device) -> None:
    # Without a top-p row the sampler takes a topk path, with one it sorts: same result,
    # ties with the k-th logit kept in both.
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]], device=device)
    sampler = Sampler()
    alone = sampler.process_logits(logits[:1], [_req(top_k=2)])
    with_top_p = sampler.process_logits(logits, [_req(top_k=2), _req(top_p=0.7)])
    assert torch.equal(alone[0], with_top_p[0])
    assert torch.isfinite(alone[0]).tolist() == [True, True, True, False, False]
    assert torch.isfinite(with_top_p[1]).tolist() == [False, False, False, True, True]


def _row(probs: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(probs, device=device).log().unsqueeze(0)  # [1, V]


def test_top_p_keeps_smallest_prefix_reaching_mass(device: torch.device) -> None:
    logits = _row([0.05, 0.5, 0.15, 0.3], device)
    sampler = Sampler()
    for top_p, kept in [(0.4, [1]), (0.75, [1, 3]), (0.85, [1, 2, 3]), (1.0, [0, 1, 2, 3])]:
        processed = sampler.process_logits(logits, [_req(top_p=top_p)])
        assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == kept


def test_top_p_after_top_k_uses_renormalised_mass(device: torch.device) -> None:
    # After top_k=2 the mass is {0.5/0.8, 0.3/0.8} = {0.625, 0.375}: top_p 0.6 keeps one token.
    logits = _row([0.05, 0.5, 0.15, 0.3], device)
    processed = Sampler().process_logits(logits, [_req(top_k=2, top_p=0.6)])
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [1]


def test_min_p(device: torch.device) -> None:
    logits = _row([0.5, 0.3, 0.15, 0.05], device).repeat(2000, 1)  # [2000, 4]
    requests = [_req(min_p=0.2) for _ in range(2000)]  # threshold 0.1: token 3 is dropped
    sampler = Sampler()
    processed = sampler.process_logits(logits[:1], requests[:1])
    assert torch.isfinite(processed[0]).tolist() == [True, True, True, False]
    torch.manual_seed(1)
    counts = torch.bincount(sampler.sample(logits, requests).token_ids, minlength=4)
    assert counts[3] == 0 and (counts[:3] > 0).all()


def _chi_square(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn outside the support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    ("params", "transform"),
    [
        ({"temperature": 1.0}, lambda x: x),
        ({"temperature": 0.5}, lambda x: x / 0.5),
        (
            {"temperature": 2.0, "top_k": 4},
            lambda x: (x / 2.0).masked_fill(x < x.topk(4).values[-1], -math.inf),
        ),
    ],
)
def test_distribution_matches_softmax(
    params: dict[str, float], transform: object, device: torch.device
) -> None:
    num_rows = 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], device=device)  # [8]
    probs = transform(base).softmax(-1).cpu()  # type: ignore[operator]
    torch.manual_seed(1234)
    out = Sampler().sample(base.repeat(num_rows, 1), [_req(**params) for _ in range(num_rows)])
    # 8 categories (7 dof): the 0.1% critical value of chi-square is 24.3.
    assert _chi_square(out.token_ids.cpu(), probs) < 24.3


def test_seeded_rows_sample_correctly(device: torch.device) -> None:
    # Seeded draws (one generator per row) follow the same distribution.
    base = torch.tensor([1.0, 0.0, -1.0, 0.5], device=device)
    num_rows = 4000
    requests = [_req(seed=i) for i in range(num_rows)]
    out = Sampler().sample(base.repeat(num_rows, 1), requests)
    assert _chi_square(out.token_ids.cpu(), base.softmax(-1).cpu()) < 16.3  # 3 dof, 0.1%


def _step_logits(step: int, vocab_size: int = 64) -> torch.Tensor:
    """The logits a fixed model would give the seeded request at ``step`` ([V])."""
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + step))


def _run_seeded(
    target: Request, companions: list[Request], device: torch.device, num_steps: int = 20
) -> list[int]:
    sampler = Sampler()
    tokens = []
    for step in range(num_steps):
        batch = companions[step % (len(companions) + 1) :] + [target]
        batch += companions[: step % (len(companions) + 1)]
        logits = torch.stack(
            [_step_logits(step) if r is target else torch.randn(64) for r in batch]
        ).to(device)  # [R, V]
        out = sampler.sample(logits, batch)
        for r, t in zip(batch, out.token_ids.tolist(), strict=True):
            r.output_token_ids.append(t)
        tokens.append(out.token_ids.tolist()[batch.index(target)])
    return tokens


def test_seed_reproducible_alone_and_in_any_batch(device: torch.device) -> None:
    params = {"seed": 77, "temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.2}
    alone = _run_seeded(_req(**params), [], device)
    companions = [
        _req(temperature=0.0),
        _req(temperature=1.3),
        _req(seed=5, top_k=8, logprobs=2),
        _req(temperature=0.7, presence_penalty=1.0, min_p=0.1),
    ]
    torch.manual_seed(99)
    in_batch = _run_seeded(_req(**params), companions, device)
    assert alone == in_batch
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_differ_and_remove_resets(device: torch.device) -> None:
    logits = torch.zeros(2, 1000, device=device)  # uniform: every draw is visible in the result
    sampler = Sampler()
    a, b = _req(seed=1, request_id="a"), _req(seed=2, request_id="b")
    runs = [sampler.sample(logits, [a, b]).token_ids.tolist() for _ in range(5)]
    seq_a, seq_b = [r[0] for r in runs], [r[1] for r in runs]
    assert seq_a != seq_b
    assert len(set(seq_a)) > 1  # the generator advances between steps
    sampler.remove(["a"])
    again = [sampler.sample(logits[:1], [_req(seed=1, request_id="a")]).token_ids.item()]
    assert again == seq_a[:1]


def test_repetition_penalty_exact(device: torch.device) -> None:
    logits = torch.tensor([[2.0, 2.0, -1.0, 3.0, -4.0]], device=device)
    request = _req(prompt=[1], output=[2, 2], repetition_penalty=2.0)
    processed = Sampler().process_logits(logits, [request])
    assert processed.tolist() == [[2.0, 1.0, -2.0, 3.0, -4.0]]


def test_presence_and_frequency_penalties_exact(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]], device=device)
    request = _req(prompt=[0], output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)
    processed = Sampler().process_logits(logits, [request])
    assert processed.tolist() == [[1.0, 1.0, 0.0, 0.25, 1.0]]  # prompt token 0 untouched


def test_penalty_order_and_per_row_isolation(device: torch.device) -> None:
    # repetition first (4 -> 2), then presence (2 -> 1.5), then temperature (1.5 / 0.5 = 3).
    logits = torch.tensor([[4.0, 0.0, 1.0], [4.0, 0.0, 1.0]], device=device)
    penalised = _req(output=[0], repetition_penalty=2.0, presence_penalty=0.5, temperature=0.5)
    plain = _req(output=[0])
    processed = Sampler().process_logits(logits, [penalised, plain])
    assert processed.tolist() == [[3.0, 0.0, 2.0], [4.0, 0.0, 1.0]]


def test_penalties_apply_to_greedy_rows(device: torch.device) -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]], device=device)
    out = Sampler().sample(logits, [_req(output=[0], temperature=0.0, frequency_penalty=2.0)])
    assert out.token_ids.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids(device: torch.device) -> None:
    logits = torch.tensor([[9.0, 0.0, 1.0, 8.0], [9.0, 0.0, 1.0, 8.0]], device=device)
    params = {"temperature": 0.0, "min_tokens": 2, "stop_token_ids": [3]}
    young = _req(output=[1], eos=frozenset({0}), **params)
    grown = _req(output=[1, 1], eos=frozenset({0}), **params)
    sampler = Sampler()
    processed = sampler.process_logits(logits, [young, grown])
    assert processed[0].tolist() == [-math.inf, 0.0, 1.0, -math.inf]
    assert processed[1].tolist() == logits[1].tolist()
    assert sampler.sample(logits, [young, grown]).token_ids.tolist() == [2, 0]


def test_mixed_batch_greedy_rows_take_processed_argmax(device: torch.device) -> None:
    torch.manual_seed(3)
    logits = _logits(6, 40, device, seed=4)
    requests = [
        _req(temperature=0.0, output=[int(logits[0].argmax())], repetition_penalty=10.0)
        if i == 0
        else _req(temperature=0.0 if i % 2 == 0 else 1.0)
        for i in range(6)
    ]
    sampler = Sampler()
    processed = sampler.process_logits(logits, requests)
    out = sampler.sample(logits, requests).token_ids
    greedy_rows = [0, 2, 4]
    assert out[greedy_rows].tolist() == processed[greedy_rows].argmax(-1).tolist()
    assert out[0] != logits[0].argmax()


def test_logprobs_from_raw_logits(device: torch.device) -> None:
    torch.manual_seed(5)
    logits = _logits(4, 30, device, seed=6)
    requests = [
        _req(logprobs=3, temperature=0.5, repetition_penalty=1.5, output=[1, 2]),
        _req(),
        _req(
            logprobs=0, temperature=0.0, repetition_penalty=100.0, output=[int(logits[2].argmax())]
        ),
        _req(logprobs=20, top_k=3),
    ]
    out = Sampler().sample(logits, requests)
    raw = torch.log_softmax(logits, -1)  # [R, V]
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        entry = out.logprobs[i]
        assert entry is not None
        token = int(out.token_ids[i])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert entry.rank == 1 + int((raw[i] > raw[i, token]).sum())
        n = requests[i].sampling_params.logprobs
        order = raw[i].argsort(descending=True)[:n]
        assert [t for t, _ in entry.top] == order.tolist()
        assert [v for _, v in entry.top] == pytest.approx(raw[i, order].tolist(), abs=1e-6)
    assert out.logprobs[2].rank > 1  # the penalty moved greedy away from the raw top token
    assert out.logprobs[2].top == []


def test_remove_unknown_ids_and_bad_shape(device: torch.device) -> None:
    sampler = Sampler()
    sampler.remove(["never-seen"])
    with pytest.raises(ValueError, match="requests"):
        sampler.sample(torch.zeros(2, 5, device=device), [_req()])


def test_input_logits_untouched(device: torch.device) -> None:
    logits = _logits(3, 20, device, seed=7)
    before = logits.clone()
    requests = [_req(repetition_penalty=2.0, output=[1]), _req(top_k=2), _req(min_tokens=3)]
    Sampler().sample(logits, requests)
    assert torch.equal(logits, before)


def test_output_on_logits_device(device: torch.device) -> None:
    logits = _logits(5, 50, device, seed=8)
    requests = [_req(temperature=0.0, repetition_penalty=1.3, output=[3]), _req(top_k=1)]
    requests += [_req(seed=3), _req(logprobs=4, min_p=0.5), _req(temperature=0.0)]
    out = Sampler().sample(logits, requests)
    assert out.token_ids.device == logits.device and out.token_ids.dtype == torch.int64
    assert out.token_ids[1] == logits[1].argmax() and out.token_ids[4] == logits[4].argmax()
    assert out.logprobs[3] is not None and len(out.logprobs[3].top) == 4


def test_chunked_greedy_argmax_matches_argmax_with_ties() -> None:
    """The chunked argmax (CUDA fast path for large vocabularies) picks torch's token, the
    lowest index among tied maxima, including ties across and inside chunks."""
    from roofline.layers.sampler import _vocab_chunks, greedy_argmax

    vocab = 128256
    assert _vocab_chunks(vocab) == 501 or vocab % _vocab_chunks(vocab) == 0
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen).to(torch.bfloat16).float()  # many ties
    logits[1, 70000] = logits[1, 90000] = logits[1, 5] = 50.0  # ties across chunks
    logits[2, 300] = logits[2, 301] = 60.0  # tie inside one chunk
    logits[3] = 0.0  # everything tied
    want = logits.argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits, chunked=True), want)
    assert want[1] == 5 and want[2] == 300 and want[3] == 0
    odd = torch.randn(2, 9973, generator=gen)  # prime vocabulary: the plain path
    assert torch.equal(greedy_argmax(odd, chunked=True), odd.argmax(dim=-1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 1e-6},
        {"temperature": 0.0, "logprobs": 1},
        {"temperature": 0.0, "min_tokens": 2},
        {"temperature": 0.0, "repetition_penalty": 1.1},
        {"temperature": 0.0, "presence_penalty": 0.5},
        {"temperature": 0.0, "frequency_penalty": 0.5},
        {"temperature": 0.0, "top_k": 3, "seed": 1},
    ],
)
def test_argmax_only_flag_matches_the_sampler_rules(kwargs: dict) -> None:
    """``Request.argmax_only`` (the sampler's one-flag fast path) holds exactly for plain greedy
    rows without logprobs or ``min_tokens``, and takes the same ids as the full scan."""
    from roofline.layers.sampler import SAMPLING_EPS, _plain_greedy

    params = SamplingParams(max_tokens=4, **kwargs)
    r = Request("a", [1, 2], params, max_tokens=4)
    expected = _plain_greedy(r) and params.logprobs is None and not params.min_tokens
    assert r.argmax_only == expected and SAMPLING_EPS == 1e-5
    if r.argmax_only:
        logits = torch.randn(3, 50)
        out = Sampler().sample(logits, [r, r, r])
        assert out.token_ids.tolist() == logits.argmax(-1).tolist()
