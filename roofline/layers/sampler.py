"""Token sampling for one step: each row's logits become the row's next token id.

The rows' parameters (temperature, top-k/top-p/min-p, penalties, min_tokens) are gathered into
tensors once per call (:class:`SamplingTensors`) and applied to the whole batch in vLLM's order:
min_tokens masking, repetition penalty, presence/frequency penalties, temperature, top-k, top-p,
min-p. Greedy rows take the argmax of the processed logits (or of the raw logits when no row
needs processing); random rows sample by the exponential race ``argmax(probs / q)`` with
``q ~ Exp(1)``, one vocab-sized draw per row. A seeded request draws its ``q`` from its own
``torch.Generator`` (kept here, keyed by request id, until :meth:`Sampler.remove`), so a seed
gives the same tokens alone or inside any batch; unseeded rows share one draw from the global
RNG. Log-probabilities come from the raw logits, before any penalty or temperature.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import torch
from torch import Tensor

from roofline.core.outputs import TokenLogprobs
from roofline.request import Request

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (dividing by them would overflow float32)."""


class SamplerOutput(NamedTuple):
    token_ids: Tensor
    """[num_rows] int64 on the logits' device: the sampled token of each row."""
    logprobs: list[TokenLogprobs | None]
    """One entry per row; None where the row's request did not ask for logprobs."""


def _row_tensor(values: list[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [R, 1]


def _flat_positions(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """Positions ``row * (vocab_size + 1) + token_id`` ([N] int64) of ragged per-row token
    lists in a flattened [R, vocab_size + 1] tensor; ids outside the vocabulary land in the
    extra last column, which callers drop."""
    ids = array("q", chain.from_iterable(rows))  # one C-level pass, no per-token Python
    if len(ids) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    token_ids = torch.frombuffer(ids, dtype=torch.int64).to(device)  # [N]
    lengths = torch.tensor([len(r) for r in rows], device=device)  # [R]
    row_ids = torch.repeat_interleave(
        torch.arange(len(rows), device=device), lengths, output_size=len(ids)
    )  # [N]
    in_vocab = (token_ids >= 0) & (token_ids < vocab_size)  # [N]
    return row_ids * (vocab_size + 1) + torch.where(in_vocab, token_ids, vocab_size)  # [N]


def _token_mask(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    positions = _flat_positions(rows, vocab_size, device)  # [N]
    mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    mask.view(-1)[positions] = True
    return mask[:, :vocab_size]  # [R, V]


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    positions = _flat_positions(rows, vocab_size, device)  # [N]
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    ones = torch.ones(positions.shape, dtype=torch.float32, device=device)  # [N]
    counts.view(-1).scatter_add_(0, positions, ones)
    return counts[:, :vocab_size]  # [R, V]


@dataclass
class SamplingTensors:
    """The per-row parameters of one call. A field is None when no row uses that feature, so
    the step skips it; inside a used field, rows that do not use it hold a neutral value."""

    greedy: list[bool]
    """Per row: temperature below ``SAMPLING_EPS`` (argmax instead of sampling)."""
    banned: Tensor | None
    """[R, V] bool: EOS and stop token ids of rows still under their ``min_tokens``."""
    repetition_penalty: Tensor | None
    """[R, 1] float32 (1.0 where unused)."""
    seen: Tensor | None
    """[R, V] bool: prompt or output tokens of rows with a repetition penalty."""
    presence_penalty: Tensor | None
    """[R, 1] float32 (0.0 where unused)."""
    frequency_penalty: Tensor | None
    """[R, 1] float32 (0.0 where unused)."""
    output_counts: Tensor | None
    """[R, V] float32: occurrences of each token in the output of rows with such a penalty."""
    temperature: Tensor | None
    """[R, 1] float32 (1.0 on greedy rows)."""
    top_k: Tensor | None
    """[R, 1] int64 in [1, V] (V where unused)."""
    max_top_k: int
    """The largest k of the rows that use top-k (0 when none does)."""
    top_p: Tensor | None
    """[R, 1] float32 (inf where unused, so that float rounding never trims anything)."""
    log_min_p: Tensor | None
    """[R, 1] float32: log(min_p), -inf where unused."""

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @property
    def needs_processing(self) -> bool:
        """Whether the logits differ from the raw ones before sampling/argmax."""
        fields = (self.banned, self.repetition_penalty, self.output_counts, self.temperature)
        fields += (self.top_k, self.top_p, self.log_min_p)
        return any(f is not None for f in fields)

    @classmethod
    def from_requests(
        cls, requests: list[Request], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        greedy: list[bool] = []
        banned_ids: list[list[int]] = []
        rep: list[float] = []
        seen_ids: list[list[int]] = []
        pres: list[float] = []
        freq: list[float] = []
        counted_ids: list[list[int]] = []
        temp: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        log_min_p: list[float] = []
        for r in requests:
            p = r.sampling_params
            is_greedy = p.temperature < SAMPLING_EPS
            greedy.append(is_greedy)
            under_min = r.num_output_tokens < p.min_tokens
            banned_ids.append(sorted(r.eos_token_ids | set(p.stop_token_ids)) if under_min else [])
            rep.append(p.repetition_penalty)
            seen_ids.append(r.all_token_ids if p.repetition_penalty != 1.0 else [])
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            counted = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            counted_ids.append(r.output_token_ids if counted else [])
            # Greedy rows skip temperature and truncation: the top token survives all of them.
            temp.append(1.0 if is_greedy else p.temperature)
            use_top_k = not is_greedy and 0 < p.top_k < vocab_size
            top_k.append(p.top_k if use_top_k else vocab_size)
            top_p.append(math.inf if is_greedy or p.top_p >= 1.0 else p.top_p)
            use_min_p = not is_greedy and p.min_p > 0.0
            log_min_p.append(math.log(p.min_p) if use_min_p else -math.inf)

        def row_tensor_if(used: bool, values: list[float]) -> Tensor | None:
            return _row_tensor(values, device) if used else None

        return cls(
            greedy=greedy,
            banned=_token_mask(banned_ids, vocab_size, device) if any(banned_ids) else None,
            repetition_penalty=row_tensor_if(any(seen_ids), rep),
            seen=_token_mask(seen_ids, vocab_size, device) if any(seen_ids) else None,
            presence_penalty=row_tensor_if(any(v != 0.0 for v in pres), pres),
            frequency_penalty=row_tensor_if(any(v != 0.0 for v in freq), freq),
            output_counts=(
                _token_counts(counted_ids, vocab_size, device) if any(counted_ids) else None
            ),
            temperature=row_tensor_if(any(v != 1.0 for v in temp), temp),
            top_k=(
                torch.tensor(top_k, dtype=torch.int64, device=device).unsqueeze(1)  # [R, 1]
                if any(k < vocab_size for k in top_k)
                else None
            ),
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
            top_p=row_tensor_if(any(v != math.inf for v in top_p), top_p),
            log_min_p=row_tensor_if(any(v != -math.inf for v in log_min_p), log_min_p),
        )


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """min_tokens masking, then the repetition penalty, then presence/frequency penalties."""
    if t.banned is not None:
        logits = logits.masked_fill(t.banned, -math.inf)  # [R, V]
    if t.repetition_penalty is not None and t.seen is not None:
        rp = t.repetition_penalty  # [R, 1]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)  # [R, V]
        logits = torch.where(t.seen, penalised, logits)  # [R, V]
    if t.output_counts is not None:
        counts = t.output_counts  # [R, V]
        if t.frequency_penalty is not None:
            logits = logits - t.frequency_penalty * counts  # [R, V]
        if t.presence_penalty is not None:
            logits = logits - t.presence_penalty * (counts > 0).to(logits.dtype)  # [R, V]
    return logits


def apply_truncation(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature, then top-k, top-p and min-p; dropped tokens get -inf. Top-k keeps every
    token tied with the k-th largest logit, so a row's result never depends on its batch."""
    if t.temperature is not None:
        logits = logits / t.temperature  # [R, V]
    vocab_size = logits.shape[1]
    if t.top_k is not None and t.top_p is None:
        # A top-k of the batch's largest k is far cheaper than sorting the vocabulary.
        top_values = logits.topk(t.max_top_k, dim=-1).values  # [R, max_top_k]
        kth = top_values.gather(1, t.top_k.clamp(max=t.max_top_k) - 1)  # [R, 1]
        kth = kth.masked_fill(t.top_k >= vocab_size, -math.inf)
        logits = logits.masked_fill(logits < kth, -math.inf)  # [R, V]
    elif t.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
        if t.top_k is not None:
            kth = sorted_logits.gather(1, t.top_k - 1)  # [R, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
        probs = sorted_logits.softmax(dim=-1)  # [R, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [R, V]
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = mass_before >= t.top_p  # [R, V]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)  # [R, V]
    if t.log_min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        threshold = logits.amax(dim=-1, keepdim=True) + t.log_min_p  # [R, 1]
        logits = logits.masked_fill(logits < threshold, -math.inf)  # [R, V]
    return logits


def greedy_argmax(logits: Tensor, chunked: bool | None = None) -> Tensor:
    """``logits.argmax(-1)`` ([R, V] -> [R] int64), ties to the lowest index, as torch's.

    On CUDA a few rows over a large vocabulary reduce poorly in one pass (one block per row:
    27.6 us for 1 x 128256 on the H100), so the row is viewed as [C, V / C] chunks: a max per
    chunk (ties to the lowest index inside it), then the first chunk holding the largest max.
    ``chunked`` forces either path (tests)."""
    rows, vocab = logits.shape
    if not logits.is_cuda and chunked is None:  # the CPU kernels' pool, where it owns the cores
        from roofline.kernels.cpu.ops import argmax_rows

        if (ids := argmax_rows(logits)) is not None:
            return ids
    num_chunks = _vocab_chunks(vocab)
    if chunked is None:
        chunked = logits.is_cuda and rows <= 64 and num_chunks > 1
    if not chunked or num_chunks <= 1:
        return logits.argmax(dim=-1)
    values, inner = logits.view(rows, num_chunks, vocab // num_chunks).max(dim=-1)  # [R, C]
    chunk = values.argmax(dim=-1, keepdim=True)  # [R, 1]: first chunk with the row's max
    return (chunk * (vocab // num_chunks) + inner.gather(1, chunk)).squeeze(1)  # [R]


def _vocab_chunks(vocab: int) -> int:
    """The largest divisor of ``vocab`` in [64, 512] (0 when there is none, or V < 8192)."""
    if vocab < 8192:
        return 0
    return next((c for c in range(512, 63, -1) if vocab % c == 0), 0)


def _plain_greedy(r: Request) -> bool:
    """Greedy with nothing that changes the logits' argmax (penalties, min_tokens masking)."""
    p = r.sampling_params
    return (
        p.temperature < SAMPLING_EPS
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and r.num_output_tokens >= p.min_tokens
    )


_ARGMAX_ONLY = attrgetter("argmax_only")


def _scan_params(requests: list[Request]) -> tuple[bool, bool]:
    """(every row is ``_plain_greedy``, some row asks for logprobs) in one pass: once per
    step over every sampled row, so the per-row rule is inlined here."""
    eps = SAMPLING_EPS
    logprobs = False
    for r in requests:
        p = r.sampling_params
        if not (
            p.temperature < eps
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and (not p.min_tokens or r.num_output_tokens >= p.min_tokens)
        ):
            return False, True  # the general path computes what it needs
        if p.logprobs is not None:
            logprobs = True
    return True, logprobs


class Sampler:
    """Samples one token per row; owns the generators of seeded requests."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget the state (generators) of finished or aborted requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def process_logits(self, logits: Tensor, requests: list[Request]) -> Tensor:
        """The float32 logits that sampling (or argmax, on greedy rows) sees ([R, V])."""
        t = SamplingTensors.from_requests(requests, logits.shape[-1], logits.device)
        return self._process(logits.float(), t)

    def sample(self, logits: Tensor, requests: list[Request]) -> SamplerOutput:
        """``logits[i]`` ([num_rows, vocab], float32 or the model's 16-bit dtype) belongs to
        ``requests[i]``. Plain greedy rows without logprobs take the argmax of the logits as
        given (a 16-bit value and its exact float32 cast have the same order and ties), the rest
        sees float32."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        if all(map(_ARGMAX_ONLY, requests)):  # the common case, one C-level pass
            return SamplerOutput(greedy_argmax(logits), [None] * len(requests))  # [R]
        plain, logprobs = _scan_params(requests)
        if plain:  # no tensors to build
            if not logprobs:
                return SamplerOutput(greedy_argmax(logits), [None] * len(requests))  # [R]
            logits = logits.float()  # [R, V]
            token_ids = greedy_argmax(logits)  # [R]
            return SamplerOutput(token_ids, self._logprobs(logits, token_ids, requests))
        logits = logits.float()  # [R, V]; the caller's tensor is never written
        t = SamplingTensors.from_requests(requests, logits.shape[1], logits.device)
        if not t.needs_processing and t.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [R]
        else:
            processed = self._process(logits, t)  # [R, V]
            random_rows = [i for i, g in enumerate(t.greedy) if not g]
            if not random_rows:
                token_ids = processed.argmax(dim=-1)  # [R]
            elif len(random_rows) == len(requests):
                token_ids = self._race(processed, requests)  # [R]
            else:
                token_ids = processed.argmax(dim=-1)  # [R]
                rows = torch.tensor(random_rows, device=logits.device)  # [num_random]
                sampled = self._race(processed[rows], [requests[i] for i in random_rows])
                token_ids[rows] = sampled
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, requests))

    @staticmethod
    def _process(logits: Tensor, t: SamplingTensors) -> Tensor:
        return apply_truncation(apply_penalties(logits, t), t)

    def generator(self, request: Request, device: torch.device) -> torch.Generator:
        """The seeded request's own generator (the verifier draws from it too)."""
        return self._generator(request, device)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = generator
        return generator

    def _race(self, logits: Tensor, requests: list[Request]) -> Tensor:
        """Exponential race over the rows of ``logits`` ([n, V]); returns [n] int64."""
        probs = logits.softmax(dim=-1)  # [n, V]
        seeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is not None]
        if not seeded:
            q = torch.empty_like(probs).exponential_()  # [n, V]
        else:
            q = torch.empty_like(probs)  # [n, V]
            for i in seeded:
                q[i].exponential_(generator=self._generator(requests[i], probs.device))
            unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
            if unseeded:
                rows = torch.tensor(unseeded, device=probs.device)  # [n_unseeded]
                shared = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
                q[rows] = shared.exponential_()  # [n_unseeded, V]
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)  # [n]

    @staticmethod
    def _logprobs(
        logits: Tensor, token_ids: Tensor, requests: list[Request]
    ) -> list[TokenLogprobs | None]:
        """Logprobs of the sampled tokens and the top-N, from the raw logits ([R, V])."""
        result: list[TokenLogprobs | None] = [None] * len(requests)
        asked = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not asked:
            return result
        rows = torch.tensor(asked, device=logits.device)  # [A]
        logprobs = torch.log_softmax(logits[rows], dim=-1)  # [A, V]
        sampled = token_ids[rows].unsqueeze(1)  # [A, 1]
        sampled_logprob = logprobs.gather(1, sampled)  # [A, 1]
        rank = (logprobs > sampled_logprob).sum(dim=-1) + 1  # [A]
        num_top = min(
            max(requests[i].sampling_params.logprobs or 0 for i in asked), logits.shape[1]
        )
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [A, num_top]
        sampled_list = sampled.squeeze(1).tolist()
        logprob_list = sampled_logprob.squeeze(1).tolist()
        rank_list = rank.tolist()
        top_value_list, top_id_list = top_values.tolist(), top_ids.tolist()
        for j, i in enumerate(asked):
            n = requests[i].sampling_params.logprobs or 0
            top = list(zip(top_id_list[j][:n], top_value_list[j][:n], strict=True))
            result[i] = TokenLogprobs(sampled_list[j], logprob_list[j], rank_list[j], top)
        return result
