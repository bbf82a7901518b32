"""Benchmark-only proposer with a known acceptance rate.

Random weights accept nothing a real proposer guesses, so the machinery is measured with a
proposer that knows the target's greedy continuation of each prompt (from a first run without
speculation, given through :meth:`OracleProposer.set_reference`) and proposes it with each
token independently replaced, with probability ``1 - alpha``, by a different token. Under greedy
verification each proposal is then accepted with probability alpha given its predecessors were,
which is the i.i.d. model ``roofline plan specdec`` assumes. Requests whose prompt it does not
know get no proposals.

The corruption of output position ``p`` of a prompt is drawn once (a uniform and a shift per
position, from the seed and the prompt), not per call: a run is then a function of the
reference and alpha alone, so a benchmark can iterate "reference <- this run's output" to a
fixed point where the verify path's own numerics produced the reference (random weights have
near-tied argmaxes that a decode step and a verification step round differently).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np
from torch import Tensor

from roofline.request import Request
from roofline.spec_decode.proposer import Proposals


class OracleProposer:
    needs_hidden_states = False

    def __init__(
        self, num_speculative_tokens: int, acceptance_rate: float, vocab_size: int, seed: int
    ) -> None:
        self.k = num_speculative_tokens
        self.alpha = acceptance_rate
        self.vocab_size = vocab_size
        self.seed = seed
        self._reference: dict[tuple[int, ...], list[int]] = {}
        self._draws: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        """Per prompt: a uniform and a corruption shift per output position, fixed by the
        seed and the prompt, so a run is a function of (reference, alpha) alone."""

    def set_reference(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]):
        """The target's greedy output token ids for each prompt's token ids."""
        for prompt, output in zip(prompts, outputs, strict=True):
            key = tuple(prompt)
            self._reference[key] = list(output)
            n = len(output) + self.k
            draws = self._draws.get(key)
            if draws is None or len(draws[0]) < n:
                crc = zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())
                rng = np.random.default_rng([self.seed, crc])
                shifts = rng.integers(1, self.vocab_size, n)
                self._draws[key] = (rng.random(n), shifts)

    def remove(self, request_ids: Iterable[str]) -> None:
        pass  # stateless per request

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals:
        out: list[list[int]] = []
        vocab = self.vocab_size
        for r, max_len in zip(requests, max_lens):
            key = tuple(r.prompt_token_ids)
            ref = self._reference.get(key)
            k = min(self.k, max_len)
            if ref is None or k <= 0:
                out.append([])
                continue
            done = r.num_output_tokens
            truth = ref[done : done + k]
            uniforms, shifts = self._draws[key]
            out.append(
                [
                    t if uniforms[done + i] < self.alpha else (t + int(shifts[done + i])) % vocab
                    for i, t in enumerate(truth)
                ]
            )
        return Proposals(out)
