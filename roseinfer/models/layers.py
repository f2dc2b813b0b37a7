"""Building blocks shared by the model families."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core import tp
from roseinfer.core.attention import get_context
from roseinfer.models.fused import apply_rope, rope_rows, rotate_qk_


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


class PagedAttention(nn.Module):
    """Appends this step's K/V to the paged cache, then attends through it."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        ctx.kv_cache.append(self.layer_idx, k, v)
        cache = ctx.kv_cache
        out = ctx.attention.forward(q, cache.k[self.layer_idx], cache.v[self.layer_idx],
                                    ctx.attn, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE from precomputed cos/sin tables."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        super().__init__()
        self._spec = (inv_freq.float().cpu(), max_positions, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device=None) -> None:
        """(Re)build the tables, e.g. after the module was created on the meta device."""
        inv_freq, max_positions, scaling = self._spec
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        device = device or self.cos.device
        self.cos = (freqs.cos() * scaling).to(device)
        self.sin = (freqs.sin() * scaling).to(device)

    def forward(self, positions, q, k, num_heads, num_kv_heads):
        """Rotates q and k in place (they may be column slices of a fused qkv)."""
        if q.is_cuda:  # one kernel gathers and rotates
            return apply_rope(q, k, positions, self.cos, self.sin, num_heads, num_kv_heads)
        memo = get_context().attn.memo
        if self not in memo:  # the first layer gathers the step's rows for all
            memo[self] = rope_rows(positions, self.cos, self.sin)
        return rotate_qk_(q, k, *memo[self], num_heads, num_kv_heads)


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
