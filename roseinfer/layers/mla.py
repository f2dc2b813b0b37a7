"""DeepSeek's multi-head latent attention (MLA), with the up-projections absorbed.

Each token's K/V is one latent vector (``kv_lora_rank`` wide, normed) and one RoPE key
(``qk_rope_head_dim``) shared by every head. The query's no-RoPE part is multiplied by
each head's key up-projection (``w_uk``) into the latent's space, so attention runs as
one-KV-head attention over ``[k_rope | latent]`` rows: scores equal the decompressed
heads' (q_nope · W_UK latent = (W_UKᵀ q_nope) · latent). The values are the same rows;
each head's output in the latent's space goes through its value up-projection
(``w_uv``) before ``o_proj``. The RoPE dims come first in a row, so the rotary layer
turns them as a partial rotary; checkpoints whose RoPE dims are interleaved pairs
(``rope_interleave``) are permuted to halves at load (``rope_halves``), which leaves
every dot product as it was.

The cache keeps each row once, as keys and values both (``values_are_keys``): 576 values
a token and layer for DeepSeek-V3's shape, against 128 heads x (192 + 128) decompressed,
71x less.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding


def softmax_scale(cfg) -> float:
    """1/sqrt(q/k head dim), times YaRN's mscale squared where the RoPE is YaRN's with
    ``mscale_all_dim`` (DeepSeek-V3's long-context checkpoints), as transformers does."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MultiLatentAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        e, bias = cfg.hidden_size, getattr(cfg, "attention_bias", False)
        self.h = tp.split(cfg.num_attention_heads, "attention heads")
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.rank, self.v = cfg.kv_lora_rank, cfg.v_head_dim
        q_width = self.h * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(e, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(e, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(e, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.w_uk = nn.Parameter(torch.empty(self.h, self.nope, self.rank))
        self.w_uv = nn.Parameter(torch.empty(self.h, self.v, self.rank))
        self.o_proj = nn.Linear(self.h * self.v, e, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, self.h, 1, self.rope + self.rank,
                                   softmax_scale(cfg), values_are_keys=True)

    def query(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(h)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))[0])

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        q_nope, q_rope = self.query(h).view(n, self.h, -1).split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(h).split([self.rank, self.rope], -1)
        latent = self.kv_a_layernorm(latent.contiguous())[0]
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk)
        q = torch.cat([q_rope, q_latent], -1).reshape(n, -1)
        k = torch.cat([k_rope, latent], -1)
        q, k = self.rotary(positions, q, k, self.h, 1)  # the RoPE dims, first in each row
        out = self.attn(q, k, k).view(n, self.h, -1)[..., self.rope:]
        return self.o_proj(torch.einsum("nhr,hvr->nhv", out, self.w_uv).reshape(n, -1))


def rope_halves(t: torch.Tensor, offset: int, width: int, rope: int) -> torch.Tensor:
    """Rows of ``t`` reordered so that, in every run of ``width`` rows from ``offset``,
    its RoPE rows (the ``rope`` rows there) go from interleaved pairs (x0, x1, x2, ...)
    to halves (x0, x2, ..., x1, x3, ...): rotate-half over them equals the interleaved
    rotation, and the dot products of two rows permuted alike are unchanged."""
    order = torch.arange(t.shape[0])
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    for start in range(offset, t.shape[0], width):
        order[start:start + rope] = start + pairs
    return t[order]
