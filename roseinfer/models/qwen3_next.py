"""Qwen3-Next (``qwen3_next``): gated DeltaNet layers (``linear_attention`` in
``layer_types``, three of every four) beside gated full attention, each followed by
Qwen2-MoE's mixture (routed experts and a sigmoid-gated shared one) or a dense MLP.

- Gated DeltaNet (layers/gated_deltanet.py) keeps a state per sequence in the
  recurrent-state cache (core/recurrent.py); the attention layers keep K/V in the paged
  cache, numbered among themselves.
- Gated attention: q_proj makes each head's query and a gate of the same width, the
  output is multiplied by sigmoid(gate) before o_proj; per-head q/k RMSNorms; partial
  rotary (``partial_rotary_factor``).
- Every RMSNorm scales by 1 + weight (its weights are offsets from one), as Gemma's.

Tensor parallelism is not yet built for it.
"""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import recurrent
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.gated_deltanet import GatedDeltaNet
from roseinfer.layers.norm import GemmaRMSNorm
from roseinfer.models.llama import heads_of
from roseinfer.models.moe import MoeForCausalLM, MoeLayer


class Qwen3NextLayer(MoeLayer):
    """MoeLayer's MLP (``init_mlp``, ``mlp``) after a gated DeltaNet or gated attention."""

    def __init__(self, cfg, layer_idx: int, rotary):
        nn.Module.__init__(self)
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        kinds = cfg.layer_types
        self.linear = kinds[layer_idx] == "linear_attention"
        self.input_layernorm = GemmaRMSNorm(e, eps)
        self.post_attention_layernorm = GemmaRMSNorm(e, eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                e, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim, eps)
        else:
            h, hkv, d = heads_of(cfg)
            self.h, self.hkv, self.d = h, hkv, d
            bias = getattr(cfg, "attention_bias", False)
            # each head's query, then its gate (q_proj's rows), then k and v
            self.qkv_proj = nn.Linear(e, (2 * h + 2 * hkv) * d, bias=bias)
            self.o_proj = nn.Linear(h * d, e, bias=bias)
            self.q_norm, self.k_norm = GemmaRMSNorm(d, eps), GemmaRMSNorm(d, eps)
            self.rotary = rotary
            attn_idx = kinds[:layer_idx].count("full_attention")
            self.attn = PagedAttention(attn_idx, h, hkv, d, d ** -0.5)
        self.init_mlp(cfg, layer_idx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        h, residual = self.input_layernorm(x, residual)
        out = self.linear_attn(h) if self.linear else self.gated_attention(h, positions)
        h, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(h), residual

    def gated_attention(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens, (hq, hkv, d) = h.shape[0], (self.h, self.hkv, self.d)
        qg, k, v = self.qkv_proj(h).split([2 * hq * d, hkv * d, hkv * d], -1)
        q, gate = qg.view(tokens, hq, 2 * d).split([d, d], -1)
        q = self.q_norm(q.reshape(-1, d))[0].view(tokens, hq * d)
        k = self.k_norm(k.reshape(-1, d))[0].view(tokens, hkv * d)
        q, k = self.rotary(positions, q, k, hq, hkv)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(tokens, hq * d))
        return self.o_proj(out)


class Qwen3NextForCausalLM(MoeForCausalLM):
    layer_class = Qwen3NextLayer
    norm_class = GemmaRMSNorm

    def __init__(self, cfg):
        recurrent.refuse_tensor_parallel("qwen3_next")
        super().__init__(cfg)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x, residual)[0]
