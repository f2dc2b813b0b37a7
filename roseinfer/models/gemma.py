"""Gemma 2 and Gemma 3 (text) on the paged KV cache. Llama's attention and gated MLP, with:

- embeddings scaled by sqrt(hidden); RMSNorms that scale by 1 + weight (layers/norm.py
  ``GemmaRMSNorm``); a norm before and after both attention and the MLP;
- GeGLU (gelu-tanh) in place of SwiGLU; scores scaled by ``query_pre_attn_scalar``;
- window layers (``layer_types``: Gemma 2 alternates them with global ones, Gemma 3 has
  five to each global one) attending over their last ``sliding_window`` tokens;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q and k normed per head, and the window layers' RoPE base apart from the
  global layers' (``rope_parameters`` by layer type). Its vision-language checkpoints
  (``gemma3``) load their text part (models/loader.py ``text_part``).
"""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.embedding import LogitsHead, VocabEmbedding
from roseinfer.layers.fused import gelu_tanh_and_mul
from roseinfer.layers.norm import GemmaRMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, rope_params
from roseinfer.models import sharding
from roseinfer.models.llama import LlamaForCausalLM, heads_of, self_attention, sliding_window


def _rotaries(cfg) -> dict[str, RotaryEmbedding]:
    """RoPE tables by layer type: one for all (Gemma 2), or the window layers' and the
    global layers' (Gemma 3)."""
    by_type = isinstance(next(iter(cfg.rope_parameters.values())), dict)
    types = set(cfg.layer_types) if by_type else {None}
    tables = {t: rope_params(cfg, t) for t in types}
    return {t: RotaryEmbedding(inv_freq, cfg.max_position_embeddings, scaling)
            for t, (inv_freq, scaling) in tables.items()}


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
        self.qk_norm, self.clip_qkv = cfg.model_type == "gemma3_text", None
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
        """(this layer's output, the residual stream before it), as Llama's layers: the
        next norm adds the two. Attention's and the MLP's outputs are normed before they
        join the stream."""
        h, residual = self.input_layernorm(x, residual)
        attn = self.post_attention_layernorm(self_attention(self, h, positions))[0]
        h, residual = self.pre_feedforward_layernorm(attn, residual)
        mlp = tp.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(h))))
        return self.post_feedforward_layernorm(mlp)[0], residual


class GemmaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        rotaries = _rotaries(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList(
            GemmaLayer(cfg, i, rotaries.get(cfg.layer_types[i], rotaries.get(None)))
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size), bias=False)
        self.head = LogitsHead(cfg.vocab_size)
        self.logit_cap = getattr(cfg, "final_logit_softcapping", None)

    def bind_head(self) -> None:
        self.head.bind(self.embed_tokens.weight if self.tied else self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # scaled in the model's dtype, as Gemma's normalizer is
        x, residual = x * torch.tensor(self.scale, dtype=x.dtype), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.logit_cap:
            logits = self.logit_cap * torch.tanh(logits / self.logit_cap)
        return logits

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """Llama's; of a Gemma 3 vision-language checkpoint, the language model's tensors
        only (``language_model.`` on disk, ``model.language_model.`` in memory)."""
        text = {}
        for key, t in sd.items():
            if not key.startswith(_NOT_TEXT):
                text[key.replace("model.language_model.", "model.")
                     .removeprefix("language_model.")] = t
        return LlamaForCausalLM.convert_hf_state_dict(text, cfg)

    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """Llama's; a vision tower's and projector's tensors are not read at all."""
        if key.startswith(_NOT_TEXT):
            return sharding.ABSENT
        return LlamaForCausalLM.shard_rule(key, cfg)


# A Gemma 3 checkpoint's image parts, left out: roseinfer serves its text part.
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")
