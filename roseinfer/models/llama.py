"""Llama family on the paged KV cache: RoPE, RMSNorm, SwiGLU, grouped-query attention.

The families that are Llama plus a flag run here too: Mistral (Llama's layers, each
attending over its sliding window), Qwen2 (bias on
q/k/v), Qwen3 (an RMSNorm on each head of q and k before RoPE) and Phi-3 (its
checkpoints hold q/k/v and gate/up already fused; partial rotary where the config
sets it). The mixture-of-experts families' attention is here too: OLMoE's q and k norms
span every head, and it may clip q, k and v (``clip_qkv``); gpt-oss has sinks."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.embedding import LogitsHead, VocabEmbedding
from roseinfer.layers.fused import HeadNorms, silu_and_mul, takes_quantized_rows
from roseinfer.layers.norm import RMSNorm, ShardedRMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, rope_params
from roseinfer.models.bert import classifies, headless
from roseinfer.models import sharding


def heads_of(cfg) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim) of the whole model."""
    h = cfg.num_attention_heads
    return h, cfg.num_key_value_heads or h, getattr(cfg, "head_dim", None) or cfg.hidden_size // h


def sliding_window(cfg, layer_idx: int) -> int | None:
    """The layer's attention window: the config's ``sliding_window`` where the family
    uses it (Qwen2's ``use_sliding_window``) and the layer is a window layer
    (``layer_types``); None where the layer sees its whole context."""
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return None
    types = getattr(cfg, "layer_types", None)
    return window if types is None or types[layer_idx] == "sliding_attention" else None


class LlamaLayer(nn.Module):
    """One decoder layer; under tensor parallelism this rank's heads and share of
    the MLP (q/k/v and gate/up split by output, o and down by input, each
    followed by a sum over the ranks)."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        e, (h, hkv, d) = cfg.hidden_size, heads_of(cfg)
        h, hkv = tp.split(h, "attention heads"), tp.kv_heads(hkv)[0]
        bias = getattr(cfg, "attention_bias", False)
        self.h, self.hkv, self.q_size, self.kv_size = h, hkv, h * d, hkv * d
        self.input_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        qkv_bias = bias or getattr(cfg, "qkv_bias", cfg.model_type == "qwen2")
        self.qkv_proj = nn.Linear(e, (h + 2 * hkv) * d, bias=qkv_bias)
        self.o_proj = nn.Linear(h * d, e, bias=bias)
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe", "olmoe", "qwen3_vl_text")
        if cfg.model_type == "olmoe":  # over all of q's heads and all of k's, not per head
            self.q_norm = ShardedRMSNorm(h * d, cfg.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(hkv * d, cfg.rms_norm_eps)
        elif self.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.clip_qkv = getattr(cfg, "clip_qkv", None)
        self.post_attention_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, h, hkv, d, d ** -0.5,
                                   window=sliding_window(cfg, layer_idx),
                                   sinks=cfg.model_type == "gpt_oss")
        self.init_mlp(cfg, layer_idx)

    def init_mlp(self, cfg, layer_idx: int) -> None:
        """The MLP's weights: a SwiGLU with gate and up fused (a family with another MLP
        overrides this and ``mlp``)."""
        inter = tp.split(cfg.intermediate_size, "intermediate size")
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of the MLP's output (the caller sums the ranks')."""
        gated = silu_and_mul(self.gate_up_proj(h), fp8=takes_quantized_rows(self.down_proj))
        return self.down_proj(gated)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        """Returns (this rank's part of the layer's output, the residual stream before it
        is added): the next norm sums the ranks' parts, adds the two and normalises, in
        one kernel where it can. ``x`` is whole (the embedding's) when residual is None."""
        # An FP8 linear's rows are rounded by the norm that makes them (a launch saved);
        # a mixture of experts has no gate_up_proj: its router reads the rows too
        h, residual = self.input_layernorm(x, residual, summed=residual is None,
                                           fp8=takes_quantized_rows(self.qkv_proj))
        attn = self_attention(self, h, positions, summed=False)
        h, residual = self.post_attention_layernorm(
            attn, residual, summed=False,
            fp8=takes_quantized_rows(getattr(self, "gate_up_proj", None)))
        return self.mlp(h), residual


def self_attention(layer: nn.Module, h: torch.Tensor, positions: torch.Tensor,
                   summed: bool = True) -> torch.Tensor:
    """The attention block of a layer built as LlamaLayer's (``qkv_proj``, q/k norms where
    ``qk_norm``, ``clip_qkv``, ``rotary``, ``attn``, ``o_proj``), summed over the ranks
    (``summed=False``: this rank's part)."""
    q, k, v = layer.qkv_proj(h).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    norms = _rope_norms(layer, q)
    if layer.qk_norm and norms is None:
        q = layer.q_norm(q.reshape(-1, layer.q_norm.weight.numel()))[0].view(-1, layer.q_size)
        k = layer.k_norm(k.reshape(-1, layer.k_norm.weight.numel()))[0].view(-1, layer.kv_size)
    if layer.clip_qkv is not None:
        q, k, v = (t.clamp(-layer.clip_qkv, layer.clip_qkv) for t in (q, k, v))
    # in place, inside qkv; or left to the KV append's launch
    rotation = layer.rotary.deferred(positions, q, layer.h, layer.hkv, norms)
    if rotation is None:
        q, k = layer.rotary(positions, q, k, layer.h, layer.hkv, norms)
    out = layer.o_proj(layer.attn(q, k, v, rotation))
    return tp.all_reduce(out) if summed else out


def _rope_norms(layer: nn.Module, q: torch.Tensor) -> HeadNorms | None:
    """The layer's q/k norms where the RoPE kernel applies them itself (two launches a
    layer fewer): per head, with nothing between them and RoPE, on CUDA."""
    if not (layer.qk_norm and q.is_cuda and layer.clip_qkv is None) or \
            isinstance(layer.q_norm, ShardedRMSNorm) or \
            2 * layer.rotary.cos.shape[-1] != layer.q_size // layer.h:  # partial rotary
        return None
    return HeadNorms(layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps,
                     layer.q_norm.unit_offset)


class LlamaForCausalLM(nn.Module):
    """A family that is Llama's shape with other parts sets them here: its layer, its
    final norm (``norm_class``, and how it is applied: ``final_norm``), whether its LM
    head is the embedding unless the config says, its RoPE tables per layer
    (``rotaries``) and its embedding's output (``embed``). A sequence-classification
    checkpoint (Qwen3's, a reward model) has ``score`` instead of an LM head: the pooling
    runner serves it."""
    layer_class = LlamaLayer
    norm_class = RMSNorm
    tied_by_default = False

    def __init__(self, cfg):
        super().__init__()
        rotaries = self.rotaries(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, rotaries[i])
                                    for i in range(cfg.num_hidden_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", self.tied_by_default))
        if classifies(cfg):  # a *ForSequenceClassification checkpoint: its score, no LM head
            self.tied, self.score = True, nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        elif headless(cfg):  # a base model (an embedder): no LM head to load
            self.tied = True
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size), bias=False)
        self.head = LogitsHead(cfg.vocab_size)

    @staticmethod
    def rotaries(cfg) -> list[RotaryEmbedding]:
        """Each layer's RoPE tables: one for all."""
        inv_freq, scaling = rope_params(cfg)
        return [RotaryEmbedding(inv_freq, cfg.max_position_embeddings, scaling)] * \
            cfg.num_hidden_layers

    def bind_head(self) -> None:
        self.head.bind(self.embed_tokens.weight if self.tied else self.lm_head.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output (this rank's part) through the final norm."""
        return self.norm(x, residual, summed=False)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """Fuse q/k/v and gate/up projections; drop the model. prefix."""
        out, parts = {}, {}
        for key, t in sd.items():
            if key == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
                continue
            key = key.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")
            *path, proj, kind = key.split(".")
            if proj in _FUSED:
                fused, i, n = _FUSED[proj]
                parts.setdefault(".".join([*path, fused, kind]), [None] * n)[i] = t
            else:
                out[key] = t
        out.update({name: torch.cat(ts, dim=0) for name, ts in parts.items()})
        return out


    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """How checkpoint tensor ``key`` splits over the ranks (models/sharding.py)."""
        (h, hkv, d), inter = heads_of(cfg), cfg.intermediate_size
        name, kind = key.split(".")[-2:]
        q, kv = sharding.heads(h, d), sharding.kv_heads(hkv, d)
        mlp = sharding.split(inter, "intermediate size")
        if name in ("embed_tokens", "lm_head"):
            return sharding.vocab(cfg.vocab_size)
        if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return {"q_proj": q, "gate_proj": mlp, "up_proj": mlp}.get(name, kv)
        if name == "qkv_proj":  # Phi-3's checkpoints fuse them already
            return sharding.joined(0, q, kv, kv, offsets=(0, h * d, (h + hkv) * d))
        if name == "gate_up_proj":
            return sharding.joined(0, mlp, mlp, offsets=(0, inter))
        if name in ("o_proj", "down_proj"):
            if kind == "bias":
                return sharding.Shard(0, once=True)
            return sharding.Shard(1, (q if name == "o_proj" else mlp).ranges)
        return None


_FUSED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
          "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}
