"""The rejection sampler keeps the target distribution: known p and q, thousands of samples.

Each verification has k = 3 proposals drawn from q_j (or one-hot guesses) and target rows whose
distribution p_j does not depend on the prefix, so the token emitted at position j (among the
verifications that reach j) must follow p_j exactly (after temperature / top-p). The check is
the Bretagnolle-Huber-Carol bound: P(||p_hat - p||_1 >= eps) <= 2^V exp(-n eps^2 / 2) for n
multinomial samples over V categories; eps is set so each check false-alarms with probability
1e-6 (seeds are fixed, so the test is deterministic). A verifier that resamples from p instead
of the residual, or that skips the bonus token, fails it (asserted below).
"""

from __future__ import annotations

import math

import pytest
import torch

from roofline.layers.sampler import Sampler
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.device_verify import launch_verification, on_device_ok
from roofline.spec_decode.verifier import Verifier

V = 6
K = 3
N = 8000
FALSE_ALARM = 1e-6


def _eps(n: int) -> float:
    return math.sqrt(2 * (V * math.log(2) + math.log(1 / FALSE_ALARM)) / n)


def _truncate_top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = p.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    out = torch.zeros_like(p)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def _run(verifier, p_rows, q_rows, one_hot: bool, params, seed: int):
    """Verify N requests; returns the emitted token lists."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1)
    # one-hot proposals may come from anywhere independent of the target's draws: from q too
    specs = torch.multinomial(q_rows, N, replacement=True, generator=gen).T.tolist()  # [N, K]
    requests, draft = [], []
    for i, spec in enumerate(specs):
        r = Request(f"r{i}", [0], params)
        r.spec_token_ids = spec
        requests.append(r)
        draft.append(None if one_hot else q_rows)
    logits = p_rows.log().repeat(N, 1)  # [N * (K + 1), V]
    out = verifier.verify(logits, requests, None if one_hot else draft)
    return [v.token_ids for v in out]


def _check(emitted, expected_rows, positions: int = K + 1):
    for j in range(positions):
        tokens = torch.tensor([e[j] for e in emitted if len(e) > j])
        n = tokens.numel()
        assert n > 100, f"too few samples reach position {j}"
        hist = torch.bincount(tokens, minlength=V).float() / n
        l1 = float((hist - expected_rows[j]).abs().sum())
        assert l1 < _eps(n), f"position {j}: L1 {l1:.4f} >= {_eps(n):.4f} over {n} samples"


def _rows(seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = (2.5 * torch.randn(K + 1, V, generator=gen)).softmax(1) + 0.01
    p = p / p.sum(1, keepdim=True)  # [K + 1, V] peaked: most proposals get accepted
    q = 0.8 * p[:K] + 0.2 * torch.rand(K, V, generator=gen)
    q = q / q.sum(1, keepdim=True)  # [K, V]
    return p, q


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "one-hot"])
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_emitted_tokens_follow_target(one_hot, top_p):
    p, q = _rows(3)
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=8)
    emitted = _run(Verifier(Sampler()), p, q, one_hot, params, seed=11)
    expected = [_truncate_top_p(p[j], top_p) for j in range(K + 1)]
    _check(emitted, expected)
    lengths = [len(e) for e in emitted]
    assert 1 <= min(lengths) and max(lengths) == K + 1


def test_temperature_is_applied():
    p, q = _rows(5)
    params = SamplingParams(temperature=0.5, max_tokens=8)
    emitted = _run(Verifier(Sampler()), p, q, False, params, seed=2)
    sharp = p**2
    # proposals from q: acceptance at T = 0.5 is lower, so check positions 0..1 only
    _check(emitted, sharp / sharp.sum(1, keepdim=True), positions=2)


class _NoResidual(Verifier):
    """A wrong verifier: after a rejection it resamples from p itself."""

    @staticmethod
    def _final_distributions(probs, requests, draft_probs, starts, num_accepted, idx):
        return torch.stack([probs[starts[i] + num_accepted[i]] for i in idx])


def test_bound_catches_a_wrong_verifier():
    p, q = _rows(3)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    emitted = _run(_NoResidual(Sampler()), p, q, False, params, seed=11)
    with pytest.raises(AssertionError):
        _check(emitted, p)


def test_greedy_accepts_the_argmax_prefix():
    p, _ = _rows(7)
    argmax = p.argmax(1).tolist()
    r = Request("g", [0], SamplingParams(temperature=0.0, max_tokens=8))
    r.spec_token_ids = [argmax[0], argmax[1], (argmax[2] + 1) % V]
    (v,) = Verifier(Sampler()).verify(p.log(), [r])
    assert v.token_ids == [argmax[0], argmax[1], argmax[2]] and v.num_proposed == K


def test_seeded_verification_reproduces():
    p, q = _rows(9)

    def once():
        r = Request("s", [0], SamplingParams(temperature=1.0, seed=123, max_tokens=8))
        r.spec_token_ids = [0, 1, 2]
        torch.manual_seed(torch.seed())  # the global RNG moves; the seed must not care
        return Verifier(Sampler()).verify(p.log(), [r])[0].token_ids

    assert len({tuple(once()) for _ in range(5)}) == 1


class _DevicePath:
    """``launch_verification`` behind ``Verifier.verify``'s signature (one-hot proposals)."""

    def verify(self, logits, requests, draft_probs=None):
        assert draft_probs is None
        out = launch_verification(logits, requests).result()
        return [out.verified[r.request_id] for r in requests]


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_device_path_emitted_tokens_follow_target(top_p):
    p, q = _rows(3)
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=8)
    emitted = _run(_DevicePath(), p, q, True, params, seed=13)
    _check(emitted, [_truncate_top_p(p[j], top_p) for j in range(K + 1)])
    assert max(len(e) for e in emitted) == K + 1


def test_device_path_matches_host_verifier_on_greedy_and_plain_rows():
    """Greedy rows with different k and a plain request (k = 0) in one step: the same tokens
    as the host verifier and the sampler."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3 + 1 + 2, V, generator=gen)  # k = 2, k = 0, k = 1
    argmax = logits.argmax(1).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    a, b, c = (Request(n, [0], greedy) for n in "abc")
    a.spec_token_ids = [argmax[0], (argmax[1] + 1) % V]
    c.spec_token_ids = [argmax[4]]
    out = launch_verification(logits, [a, b, c]).result()
    host = Verifier(Sampler()).verify(logits[[0, 1, 2, 4, 5]], [a, c])
    assert out.verified["a"].token_ids == host[0].token_ids == [argmax[0], argmax[1]]
    assert out.verified["c"].token_ids == host[1].token_ids == [argmax[4], argmax[5]]
    assert out.sampled_token_ids["b"] == argmax[3] and "b" not in out.verified
    assert on_device_ok([a, b, c])
    assert not on_device_ok([Request("s", [0], SamplingParams(seed=1, max_tokens=2))])
