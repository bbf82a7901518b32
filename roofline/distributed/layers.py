"""The vocab-parallel embedding: each rank keeps ``vocab_per_rank`` rows of the table (the last
rank's padded with zeros), looks up the ids that fall in its range, writes zeros for the others,
and an all-reduce sums the ranks' rows into the full embedding. The LM head shares the layout:
each rank computes the logits of its vocabulary slice, gathered in rank order (see
``LlamaForCausalLM.compute_logits``). Column- and row-parallel projections are ordinary
``MergedLinear`` layers built with local sizes (the loader hands them their slices) followed, for
the row-parallel ones, by ``ParallelContext.all_reduce`` in the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roofline.distributed.parallel_state import ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_per_rank: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.vocab_per_rank = vocab_per_rank
        self.vocab_start = parallel.rank * vocab_per_rank
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] global ids -> [num_tokens, hidden] (summed over ranks)
        local = input_ids - self.vocab_start  # [num_tokens]
        outside = (local < 0) | (local >= self.vocab_per_rank)  # [num_tokens]
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(x)
