"""Vocab-parallel embedding and LM head: each TP rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed import get_parallel_state, tp_all_gather, tp_all_reduce
from turnout.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab_size, hidden] split by vocabulary rows: each TP rank holds per_rank =
    ceil(vocab_size / tp) rows starting at tp_rank * per_rank, the last rank's rows past vocab_size zero.
    Under TP a rank looks up the ids in its slice, gives zeros for the others, and the ranks all-reduce."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the full checkpoint tensor loaded [vocab_size, hidden] into param."""
        shard = loaded[self.start : self.start + self.per_rank]
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """input_ids [T] -> embeddings [T, hidden], the same on every rank."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab logits, sharded by vocabulary rows as VocabParallelEmbedding
    (same weight shape and weight_loader). Tied embeddings: build both with the same sizes, assign
    `lm_head.weight = embed.weight` (one Parameter, one split), and skip a checkpoint's lm_head.weight."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self.packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout, CPU bf16 only

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] logits
        """hidden [N, hidden] -> logits [N, vocab_size]: each rank's slice, all-gathered, padding cut off."""
        logits = tp_all_gather(linear(hidden, self.weight, None, self.packed_weight), dim=-1)
        return logits[:, : self.vocab_size]
