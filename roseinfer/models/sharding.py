"""This rank's slices of a checkpoint's tensors, read without the rest.

A model family says how each checkpoint tensor splits (``shard_rule(key, cfg)``
on its class, in the checkpoint's own names): a ``Shard`` of ranges along one
dimension, concatenated (a fused q/k/v weight takes its rank's q, k and v
rows), or None to keep it whole. The loader applies the rule to a safetensors
slice, so a rank reads only its own bytes, or to a whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.core import tp


@dataclass(frozen=True)
class Shard:
    dim: int
    ranges: tuple[tuple[int, int], ...] = ()
    # A row-parallel layer's bias: the ranks' outputs are summed, so only rank 0 adds it.
    once: bool = False
    # Not this rank's at all (an expert another rank holds under expert parallelism).
    absent: bool = False


ABSENT = Shard(0, absent=True)


def rows(start: int, count: int, dim: int = 0) -> Shard:
    return Shard(dim, ((start, start + count),))


def joined(dim: int, *shards: Shard, offsets: tuple[int, ...]) -> Shard:
    """Ranges of shards of consecutive parts (q, k, v) of one fused tensor, the
    parts starting at ``offsets``."""
    return Shard(dim, tuple((o + a, o + b) for o, s in zip(offsets, shards) for a, b in s.ranges))


def vocab(size: int, dim: int = 0) -> Shard:
    """This rank's rows of a ``size``-token embedding or LM head (layers.VocabEmbedding)."""
    n = tp.vocab_shard(size)
    return rows(tp.group().rank * n, n, dim)


def heads(count: int, head_dim: int, dim: int = 0) -> Shard:
    """This rank's query heads of ``count``."""
    n = tp.split(count, "attention heads")
    return rows(tp.group().rank * n * head_dim, n * head_dim, dim)


def kv_heads(count: int, head_dim: int, dim: int = 0) -> Shard:
    """This rank's key/value heads of ``count`` (tp.kv_heads)."""
    n, first = tp.kv_heads(count)
    return rows(first * head_dim, n * head_dim, dim)


def split(size: int, what: str, dim: int = 0) -> Shard:
    """This rank's share of ``size`` rows (an MLP's intermediate)."""
    n = tp.split(size, what)
    return rows(tp.group().rank * n, n, dim)


def experts(count: int) -> range:
    """The experts of ``count`` this rank holds under expert parallelism."""
    n = tp.split(count, "experts")
    return range(tp.group().rank * n, (tp.group().rank + 1) * n)


def _shape(view) -> list[int]:
    return list(view.get_shape() if hasattr(view, "get_shape") else view.shape)


def take(view, shard: Shard | None) -> torch.Tensor:
    """``view`` (a tensor or a safetensors slice) cut by ``shard``; ranges past
    its end read as zeros (the vocabulary's padding)."""
    if shard is None:
        return view[:]
    if shard.once:
        whole = view[:]
        return whole if tp.group().rank == 0 else torch.zeros_like(whole)
    shape = _shape(view)
    parts = []
    for start, stop in shard.ranges:
        # a range may start past the end: a small vocabulary's last ranks are all padding
        lo, hi = min(start, shape[shard.dim]), min(stop, shape[shard.dim])
        part = view[(slice(None),) * shard.dim + (slice(lo, hi),)]
        if hi - lo < stop - start:
            pad = list(part.shape)
            pad[shard.dim] = stop - start - (hi - lo)
            part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
        parts.append(part)
    return torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
