"""Attention over the paged KV cache: the layer every family's attention goes through."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core.attention import get_context
from roseinfer.layers.rotary import Rotation


class PagedAttention(nn.Module):
    """Appends this step's K/V to the paged cache, then attends through it; with a
    ``window``, each query sees only the last ``window`` positions up to its own; with
    ``sinks``, a learned logit per head (``sinks``, this rank's heads) joins each row's
    softmax (gpt-oss); with ``softcap``, scores are bounded by cap * tanh(score / cap)
    (Gemma 2). The backend gets ``window=``, ``sinks=`` and ``softcap=`` only where the
    layer has them, so a backend without them serves the other models."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, window: int | None = None, sinks: bool = False,
                 softcap: float | None = None, values_are_keys: bool = False):
        super().__init__()
        # The values are the keys (latent attention, layers/mla.py): the cache keeps one
        # tensor for both, and forward's ``v`` must be its ``k``.
        self.values_are_keys = values_are_keys
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window = scale, window
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # the keywords fixed at build, made once: this runs per layer per step
        self._extra = {k: v for k, v in (("window", window), ("softcap", softcap)) if v}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotation: Rotation | None = None) -> torch.Tensor:
        """``rotation``: q's and k's RoPE, not yet applied: the append runs it where its
        backend can in the same launch (``KVCache.append_rotated``)."""
        ctx = get_context()
        cache = ctx.kv_cache
        if rotation is None or not cache.append_rotated(self.layer_idx, q, k, v, rotation):
            if rotation is not None:
                q, k = rotation.apply(q, k)
            cache.append(self.layer_idx, k.view(-1, self.num_kv_heads, self.head_dim),
                         v.view(-1, self.num_kv_heads, self.head_dim))
        q = q.view(-1, self.num_heads, self.head_dim)
        # the sinks read here: a load may have replaced the parameter
        extra = self._extra if self.sinks is None else {**self._extra, "sinks": self.sinks}
        k_cache, v_cache, group = cache.layer(self.layer_idx)
        out = ctx.attention.forward(q, k_cache, v_cache, ctx.of_group(group), self.scale,
                                    **extra)
        return out.reshape(-1, self.num_heads * self.head_dim)
