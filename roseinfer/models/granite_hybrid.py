"""IBM Granite 4.0-H (``granitemoehybrid``): Mamba2 layers with a few attention layers,
each followed by a mixture of experts beside a shared SwiGLU (or the shared one alone,
``num_local_experts`` 0).

- A layer is ``mamba`` or ``attention`` (``layer_types``, or the older
  ``layers_block_type``); the Mamba2 mixers keep a state per sequence in the recurrent-state
  cache (layers/mamba2.py, core/recurrent.py), the attention layers K/V in the paged cache,
  numbered among themselves.
- Attention: Llama's, its scores scaled by ``attention_multiplier``; RoPE where
  ``position_embedding_type`` is ``rope``, none (NoPE) otherwise.
- Granite's multipliers: the embedding's output times ``embedding_multiplier``, each
  block's output times ``residual_multiplier`` before it joins the residual, the final
  hidden state divided by ``logits_scaling``.

Tensor parallelism is not yet built for it.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from roseinfer.core import recurrent
from roseinfer.core.errors import ConfigError
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.fused import silu_and_mul
from roseinfer.layers.mamba2 import Mamba2Mixer
from roseinfer.layers.moe import SparseMoE
from roseinfer.layers.norm import RMSNorm
from roseinfer.models.llama import LlamaForCausalLM, self_attention


def layer_types(cfg) -> list[str]:
    """Each layer's kind, ``mamba`` or ``attention``."""
    kinds = getattr(cfg, "layer_types", None) or cfg.layers_block_type
    return ["mamba" if k in ("mamba", "linear_attention") else "attention" for k in kinds]


class NoRotary:
    """RoPE's place in ``self_attention`` where the family has no positions in q and k."""

    def __call__(self, positions, q, k, heads, kv_heads, norms=None):
        return q, k

    def deferred(self, positions, q, heads, kv_heads, norms=None):
        return None  # nothing for the KV append to turn


class SharedMlp(nn.Module):
    """The SwiGLU every token goes through (``input_linear``: gate rows, then up)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output_linear(silu_and_mul(self.input_linear(h)))


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary):
        super().__init__()
        e, kinds = cfg.hidden_size, layer_types(cfg)
        kind, attn_idx = kinds[layer_idx], kinds[:layer_idx].count("attention")
        self.kind, self.scale = kind, cfg.residual_multiplier
        self.input_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(
                e, int(cfg.mamba_expand * e), cfg.mamba_n_heads, cfg.mamba_d_head,
                cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv, cfg.rms_norm_eps,
                cfg.mamba_proj_bias, cfg.mamba_conv_bias,
                tuple(getattr(cfg, "time_step_limit", (0.0, float("inf")))))
        else:
            h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            d = getattr(cfg, "head_dim", None) or e // h
            self.h, self.hkv, self.q_size, self.kv_size = h, hkv, h * d, hkv * d
            self.qkv_proj = nn.Linear(e, (h + 2 * hkv) * d, bias=cfg.attention_bias)
            self.o_proj = nn.Linear(h * d, e, bias=cfg.attention_bias)
            self.qk_norm, self.clip_qkv, self.rotary = False, None, rotary
            self.attn = PagedAttention(attn_idx, h, hkv, d, cfg.attention_multiplier)
        experts = getattr(cfg, "num_local_experts", 0) or 0
        self.moe = SparseMoE(e, cfg.intermediate_size, experts, cfg.num_experts_per_tok,
                             renormalize=True) if experts else None
        self.shared_mlp = SharedMlp(e, cfg.shared_intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        """As LlamaLayer's: (the block's output, scaled, and the residual before it)."""
        h, residual = self.input_layernorm(x, residual, summed=True)
        out = self.mamba(h) if self.kind == "mamba" else self_attention(self, h, positions)
        h, residual = self.post_attention_layernorm(out * self.scale, residual, summed=True)
        mlp = self.shared_mlp(h)
        if self.moe is not None:
            mlp = mlp + self.moe(h)
        return mlp * self.scale, residual


class GraniteHybridForCausalLM(LlamaForCausalLM):
    layer_class = GraniteHybridLayer
    tied_by_default = True

    def __init__(self, cfg):
        recurrent.refuse_tensor_parallel("granitemoehybrid")
        super().__init__(cfg)
        self.embedding_multiplier = cfg.embedding_multiplier
        self.logits_scaling = cfg.logits_scaling

    @staticmethod
    def rotaries(cfg) -> list:
        """RoPE's tables where ``position_embedding_type`` is rope, else none (NoPE)."""
        if cfg.position_embedding_type == "rope":
            return LlamaForCausalLM.rotaries(cfg)
        return [NoRotary()] * cfg.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the head's input: the logits are lm_head(h) / logits_scaling
        return super().forward(input_ids, positions) / self.logits_scaling

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """q/k/v fused; the experts, stacked as transformers holds them (``experts.
        gate_up_proj``) or as checkpoints on disk do (``input_linear``, gate rows then up),
        as the MoE layer's ``w13`` and ``w2``, the router as its gate."""
        out, qkv = {}, {}
        for key, t in sd.items():
            if key == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", True):
                continue
            key = key.removeprefix("model.").replace("self_attn.", "")
            m = re.fullmatch(r"(layers\.\d+\.)(q|k|v)_proj\.(weight|bias)", key)
            if m:
                qkv.setdefault(f"{m.group(1)}qkv_proj.{m.group(3)}", {})[m.group(2)] = t
                continue
            m = re.fullmatch(r"(layers\.\d+\.)block_sparse_moe\.(.+)", key)
            if m:
                name = _EXPERTS.get(m.group(2))
                if name is None:
                    raise ConfigError(f"granitemoehybrid: no expert tensor {key!r}")
                key = f"{m.group(1)}moe.{name}"
            out[key] = t
        out.update({key: torch.cat([p["q"], p["k"], p["v"]]) for key, p in qkv.items()})
        return out


_EXPERTS = {"router.weight": "gate.weight", "router.layer.weight": "gate.weight",
            "experts.gate_up_proj": "w13", "input_linear.weight": "w13",
            "experts.down_proj": "w2", "output_linear.weight": "w2"}
