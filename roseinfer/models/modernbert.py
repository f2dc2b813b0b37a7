"""ModernBERT: an encoder for embeddings and scores (core/pooling.py) with RoPE (its base
by layer type), pre-norm layers without biases, a GeGLU MLP, and bidirectional sliding
windows (|i - j| <= ``sliding_window``) in the layers between its global ones. Module
names are transformers' (``attn.Wqkv``, ``mlp.Wi``, ...). A
``ModernBertForSequenceClassification`` checkpoint keeps its head: the first token's or
the mean state (``classifier_pooling``), then dense, activation, norm and classifier."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core.pooling import pool
from roseinfer.layers.encoder_attention import Packed, packed_attention
from roseinfer.layers.fused import apply_rope
from roseinfer.layers.rotary import RotaryEmbedding, rope_params
from roseinfer.models.bert import ACTIVATIONS, classifies


def _norm(cfg) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class ModernBertAttention(nn.Module):
    def __init__(self, cfg, layer_type: str):
        super().__init__()
        e, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.Wqkv = nn.Linear(e, 3 * e, bias=cfg.attention_bias)
        self.Wo = nn.Linear(e, e, bias=cfg.attention_bias)
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        inv_freq, scaling = rope_params(cfg, layer_type)
        self.rotary = RotaryEmbedding(inv_freq, cfg.max_position_embeddings, scaling)

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        q, k, v = self.Wqkv(x).chunk(3, dim=-1)
        q, k = apply_rope(q, k, packed.positions, self.rotary.cos, self.rotary.sin,
                          self.heads, self.heads)
        shaped = [t.reshape(t.shape[0], self.heads, -1) for t in (q, k, v)]
        return self.Wo(packed_attention(*shaped, packed, window=self.window).flatten(1))


class ModernBertMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.attn_norm = _norm(cfg) if layer_idx else None  # the first layer's is the embedding's
        self.attn = ModernBertAttention(cfg, cfg.layer_types[layer_idx])
        self.mlp_norm = _norm(cfg)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        x = x + self.attn(x if self.attn_norm is None else self.attn_norm(x), packed)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(ids))


class ModernBertHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = ACTIVATIONS[cfg.classifier_activation]
        self.norm = _norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertModel(nn.Module):
    pooling_only = True  # no LM head: the pooling runner serves it

    def __init__(self, cfg):
        super().__init__()
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _norm(cfg)
        self.head = self.classifier = None
        self.classifier_pooling = cfg.classifier_pooling
        if classifies(cfg):
            self.head = ModernBertHead(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def bind_head(self) -> None:
        """Nothing to tie: an encoder has no LM head."""

    def forward(self, ids: torch.Tensor, packed: Packed) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, packed)
        return self.final_norm(x)

    def classify(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        pooled = pool(hidden, packed, self.classifier_pooling).to(hidden.dtype)
        return self.classifier(self.head(pooled))

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """transformers' names less the ``model.`` prefix; the masked-LM head left out."""
        keep = ("embeddings.", "layers.", "final_norm.") + (
            ("head.", "classifier.") if classifies(cfg) else ())
        out = {}
        for key, t in sd.items():
            key = key.removeprefix("model.")
            if key.startswith(keep):
                out[key] = t
        return out
