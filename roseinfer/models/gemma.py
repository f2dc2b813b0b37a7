"""Gemma 2 and Gemma 3 (text) on the paged KV cache. Llama's attention and gated MLP, with:

- embeddings scaled by sqrt(hidden); RMSNorms that scale by 1 + weight (layers/norm.py
  ``GemmaRMSNorm``); a norm before and after both attention and the MLP;
- GeGLU (gelu-tanh) in place of SwiGLU; scores scaled by ``query_pre_attn_scalar``;
- window layers (``layer_types``: Gemma 2 alternates them with global ones, Gemma 3 has
  five to each global one) attending over their last ``sliding_window`` tokens;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q and k normed per head, and the window layers' RoPE base apart from the
  global layers' (``rope_parameters`` by layer type). Its vision-language checkpoints
  (``gemma3``) take images too (models/gemma3_vl.py).
"""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.fused import gelu_tanh_and_mul
from roseinfer.layers.norm import GemmaRMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, rope_params
from roseinfer.models import sharding
from roseinfer.models.llama import LlamaForCausalLM, heads_of, self_attention, sliding_window


class GemmaLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        e, (h, hkv, d) = cfg.hidden_size, heads_of(cfg)
        h, hkv = tp.split(h, "attention heads"), tp.kv_heads(hkv)[0]
        self.h, self.hkv, self.q_size, self.kv_size = h, hkv, h * d, hkv * d
        norm = lambda dim: GemmaRMSNorm(dim, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(e), norm(e)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(e), norm(e)
        self.qkv_proj = nn.Linear(e, (h + 2 * hkv) * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, e, bias=cfg.attention_bias)
        self.qk_norm, self.clip_qkv = cfg.model_type in ("gemma3_text", "gemma3"), None
        if self.qk_norm:
            self.q_norm, self.k_norm = norm(d), norm(d)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, h, hkv, d, cfg.query_pre_attn_scalar ** -0.5,
                                   window=sliding_window(cfg, layer_idx),
                                   softcap=getattr(cfg, "attn_logit_softcapping", None))
        inter = tp.split(cfg.intermediate_size, "intermediate size")
        self.gate_up_proj = nn.Linear(e, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, e, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        """(this layer's MLP output, the residual stream before it), as Llama's layers: the
        next norm adds the two. Attention's and the MLP's outputs are normed before they
        join the stream, each by the kernel that adds it: the MLP's by the next layer's
        input norm (``incoming``, the layer before's post-norm) or the final norm."""
        h, residual = self.input_layernorm(x, residual, first=self.incoming)
        attn = self_attention(self, h, positions)
        h, residual = self.pre_feedforward_layernorm(attn, residual,
                                                     first=self.post_attention_layernorm)
        return tp.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(h)))), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaLayer
    norm_class = GemmaRMSNorm
    tied_by_default = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scale = cfg.hidden_size ** 0.5
        self.logit_cap = getattr(cfg, "final_logit_softcapping", None)
        # each layer's input norm applies the post-norm of the layer before (a plain
        # attribute: the norm's weights stay the earlier layer's, listed once)
        for layer, before in zip(self.layers, [None, *self.layers[:-1]]):
            layer.__dict__["incoming"] = before and before.post_feedforward_layernorm

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x, residual, first=self.layers[-1].post_feedforward_layernorm)[0]

    @staticmethod
    def rotaries(cfg) -> list[RotaryEmbedding]:
        """One table for all layers (Gemma 2), or the window layers' and the global
        layers' (Gemma 3: ``rope_parameters`` by layer type)."""
        if not isinstance(next(iter(cfg.rope_parameters.values())), dict):
            return LlamaForCausalLM.rotaries(cfg)
        tables = {}
        for t in set(cfg.layer_types):
            inv_freq, scaling = rope_params(cfg, t)
            tables[t] = RotaryEmbedding(inv_freq, cfg.max_position_embeddings, scaling)
        return [tables[t] for t in cfg.layer_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.scale, dtype=x.dtype)  # in the model's dtype, as Gemma's

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logit_cap:
            logits = self.logit_cap * torch.tanh(logits / self.logit_cap)
        return logits

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """Llama's; of a vision-language checkpoint's, the language model's tensors
        (``language_model.`` on disk, ``model.language_model.`` in memory)."""
        text = {}
        for key, t in sd.items():
            text[key.replace("model.language_model.", "model.")
                 .removeprefix("language_model.")] = t
        return LlamaForCausalLM.convert_hf_state_dict(text, cfg)
