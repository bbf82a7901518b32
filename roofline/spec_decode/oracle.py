"""Benchmark-only proposer with a known acceptance rate, on a target with a planted successor.

Random weights accept nothing a real proposer guesses, so the machinery is measured with a
proposer that knows the target's greedy continuation and proposes it with each token
independently replaced, with probability ``1 - alpha``, by a different token. Under greedy
verification each proposal is then accepted with probability alpha given its predecessors were,
which is the i.i.d. model ``roofline plan specdec`` assumes.

A continuation taken from an earlier run does not survive contact with the run being measured:
random bf16 weights have near-tied argmaxes that a decode step and a verification step (or one
token verified in two different grid rows) round differently, and one flip derails every later
proposal of that request, so a switch that alternates plain and verification steps saw its
acceptance collapse. :func:`plant_successor` therefore gives the random target a known greedy
function of the current token with a margin no rounding can flip: the embedding is scaled up
until the residual stream is dominated by the current token's embedding, and the LM head
becomes a permuted copy of the (rescaled) embedding, so token ``x`` is followed by
``successor[x]`` (logit ~ ``0.02 x hidden`` against ~ ``0.02 sqrt(hidden)`` for the others). Every
kernel, shape and byte read is unchanged; only the values differ. The oracle proposes
``successor`` iterated from each request's *actual* last token, so it is re-synchronised to
whatever the run emitted, whichever path emitted it.

With real weights (no planting), ``set_reference`` gives each prompt's greedy output from a
first run instead; a request is then proposed its reference only while its last emitted token
agrees with it (afterwards nothing: the reference no longer describes the run).

The corruption of output position ``p`` of a prompt is a hash of (seed, prompt, p), vectorised
over the batch and independent of call order, so forced and adaptive runs of one workload see
the same acceptance stream per position.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from roofline.request import Request
from roofline.spec_decode.proposer import Proposals

EMBED_RMS = 1000.0
"""Root-mean-square of the planted embedding: ~70x the residual stream that the 32 random
Llama-3.1-8B layers add (N(0, 0.02) weights: ~14 per element), so the current token decides."""
HEAD_STD = 0.02
"""The planted LM head keeps the dummy weights' N(0, 0.02) element distribution."""
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wraps; a fixed pseudo-random function)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@torch.no_grad()
def plant_successor(model: torch.nn.Module, seed: int = 0) -> np.ndarray:
    """Make ``model``'s greedy next token a fixed function of its current token (module
    docstring); returns ``successor`` [vocab] int64. ``model`` has ``embed_tokens`` and either an
    unquantized ``lm_head`` (a random permutation is planted) or a tied head (the successor is
    then the token itself). Runs after loading; weights are changed in place (captured CUDA
    graphs stay valid); the CPU's packed copies are rebuilt."""
    embed: Tensor = model.embed_tokens.weight  # [V, hidden]
    vocab = embed.shape[0]
    rms = embed.float().pow(2).mean().sqrt().item()
    if not rms > 0:
        raise ValueError("the embedding is all zeros: nothing to plant")
    head = getattr(model, "lm_head", None)
    if head is None:
        embed.mul_(EMBED_RMS / rms)
        successor = np.arange(vocab, dtype=np.int64)
    else:
        if getattr(head.method, "quantized", False) or head.weight.shape != embed.shape:
            raise ValueError(
                "plant_successor needs an unquantized LM head shaped like the embedding"
            )
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab, generator=gen)  # head row j copies embedding row perm[j]
        for start in range(0, vocab, 16384):  # row blocks: no second full-size copy
            rows = perm[start : start + 16384].to(embed.device)
            head.weight[start : start + 16384].copy_(embed[rows].float() * (HEAD_STD / rms))
        embed.mul_(EMBED_RMS / rms)
        successor = torch.argsort(perm).numpy().astype(np.int64)  # x -> the j with perm[j] = x
    if embed.device.type == "cpu" and hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()  # MKL-packed copies of the changed weights
    return successor


class OracleProposer:
    needs_hidden_states = False
    shadows = True

    def __init__(
        self, num_speculative_tokens: int, acceptance_rate: float, vocab_size: int, seed: int
    ) -> None:
        self.k = num_speculative_tokens
        self.alpha = acceptance_rate
        self.vocab_size = vocab_size
        self.seed = seed
        self.successor: np.ndarray | None = None
        """[vocab] the target's greedy next token of each token (``plant_successor``)."""
        self._prompt_keys: dict[str, int] = {}
        """request id -> hash of its prompt (the corruption stream's key)."""
        self._reference: dict[tuple[int, ...], list[int]] = {}
        """prompt -> the target's greedy output (real weights; ``set_reference``)."""

    def set_successor(self, successor: np.ndarray) -> None:
        if successor.shape != (self.vocab_size,):
            raise ValueError(f"successor must have shape ({self.vocab_size},)")
        self.successor = np.asarray(successor, dtype=np.int64)

    def set_reference(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]):
        """Each prompt's greedy output token ids from a first run (real weights)."""
        for prompt, output in zip(prompts, outputs, strict=True):
            self._reference[tuple(prompt)] = list(output)

    def _from_reference(self, requests: list[Request]) -> np.ndarray:
        """[R, k] each request's reference continuation; -1 where there is none."""
        truth = np.full((len(requests), self.k), -1, dtype=np.int64)
        for i, r in enumerate(requests):
            ref = self._reference.get(tuple(r.prompt_token_ids))
            done = r.num_output_tokens
            if ref is None or done > len(ref):
                continue
            if done and ref[done - 1] != r.output_token_ids[-1]:
                continue  # the run left its reference
            cont = ref[done : done + self.k]
            truth[i, : len(cont)] = cont
        return truth

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._prompt_keys.pop(rid, None)

    def _key(self, r: Request) -> int:
        key = self._prompt_keys.get(r.request_id)
        if key is None:
            data = np.asarray(r.prompt_token_ids, dtype=np.int64).tobytes()
            key = self._prompt_keys[r.request_id] = zlib.crc32(data) | (self.seed << 32)
        return key

    def corrupted(self, keys: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kept: uniform < alpha, shift in 1..V-1) per (prompt key [R, 1], position [R, k])."""
        h = _mix(_mix(keys.astype(np.uint64)) ^ positions.astype(np.uint64))
        uniform = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        shift = 1 + (_mix(h) % np.uint64(self.vocab_size - 1)).astype(np.int64)
        return uniform < self.alpha, shift

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals:
        succ = self.successor
        if (succ is None and not self._reference) or not requests:
            return Proposals([[] for _ in requests])
        if succ is not None:
            last = np.fromiter(
                (r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                 for r in requests),
                dtype=np.int64, count=len(requests),
            )  # fmt: skip
            truth = np.empty((len(requests), self.k), dtype=np.int64)  # [R, k]
            for i in range(self.k):  # the target's greedy chain from each actual last token
                last = succ[last]
                truth[:, i] = last
        else:
            truth = self._from_reference(requests)  # [R, k], -1: nothing known
        keys = np.fromiter((self._key(r) for r in requests), dtype=np.int64, count=len(requests))
        done = np.fromiter((r.num_output_tokens for r in requests), np.int64, len(requests))
        positions = done[:, None] + np.arange(self.k)  # [R, k] output positions
        kept, shift = self.corrupted(keys[:, None], positions)
        tokens = np.where(kept, truth, (truth + shift) % self.vocab_size)
        known = (truth >= 0).sum(axis=1).tolist()  # a reference's known prefix
        rows = tokens.tolist()
        return Proposals([row[: min(n, m)] for row, n, m in zip(rows, max_lens, known)])
