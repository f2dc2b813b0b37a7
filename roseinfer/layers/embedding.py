"""The token embedding and the LM head, each split over the vocabulary under tensor
parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core import tp


def embedding(num: int, dim: int) -> nn.Embedding:
    """An uninitialized nn.Embedding: the loader fills every weight. Its default
    normal_ init on the meta device would import torch._dynamo (2.3 s on 2 cores)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class VocabEmbedding(nn.Embedding):
    """The token embedding. Under tensor parallelism each rank holds
    ``tp.vocab_shard`` rows from ``rank * shard`` on: a rank looks up the ids in
    its rows, zeros the others, and the ranks' lookups are summed."""

    def __init__(self, vocab: int, dim: int):
        g = tp.group()
        rows = tp.vocab_shard(vocab)
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))  # embedding() says why
        self.start = g.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp.group().size == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class LogitsHead(nn.Module):
    """The LM head, with its vocabulary padded to a multiple of 64 on CUDA.

    cuBLAS runs an odd row count (GPT-2's 50257) through a much slower kernel;
    padded rows are zeros and their logits are sliced off. Under tensor
    parallelism each rank computes its vocabulary shard's logits (the rows of
    its VocabEmbedding) and every rank gets all of them.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.linear: nn.Module | None = None

    def bind(self, weight: torch.Tensor) -> None:
        pad = (-weight.shape[0]) % 64 if weight.is_cuda else 0
        linear = nn.Linear(weight.shape[1], weight.shape[0] + pad, bias=False,
                           device="meta")
        linear.weight = nn.Parameter(F.pad(weight, (0, 0, 0, pad)) if pad else weight,
                                     requires_grad=False)
        self.linear = linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return tp.gather_columns(self.linear(hidden))[:, :self.vocab_size]
