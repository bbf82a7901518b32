"""Benchmark-only proposer with a known acceptance rate.

Random weights accept nothing a real proposer guesses, so the machinery is measured with a
proposer that knows the target's greedy continuation of each prompt (from a first run without
speculation, given through :meth:`OracleProposer.set_reference`) and proposes it with each
token independently replaced, with probability ``1 - alpha``, by a different token. Under greedy
verification each proposal is then accepted with probability alpha given its predecessors were,
which is the i.i.d. model ``roofline plan specdec`` assumes. Requests whose prompt it does not
know get no proposals.
"""

from __future__ import annotations

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
        self._rng = np.random.default_rng(seed)
        self._reference: dict[tuple[int, ...], list[int]] = {}

    def set_reference(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]):
        """The target's greedy output token ids for each prompt's token ids."""
        for prompt, output in zip(prompts, outputs, strict=True):
            self._reference[tuple(prompt)] = list(output)

    def remove(self, request_ids: Iterable[str]) -> None:
        pass  # stateless per request

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals:
        out: list[list[int]] = []
        for r, max_len in zip(requests, max_lens):
            ref = self._reference.get(tuple(r.prompt_token_ids))
            k = min(self.k, max_len)
            if ref is None or k <= 0:
                out.append([])
                continue
            done = r.num_output_tokens
            truth = ref[done : done + k]
            keep = self._rng.random(len(truth)) < self.alpha
            shift = self._rng.integers(1, self.vocab_size, len(truth))
            vocab = self.vocab_size
            out.append([t if ok else (t + int(s)) % vocab for t, ok, s in zip(truth, keep, shift)])
        return Proposals(out)
