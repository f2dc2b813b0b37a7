"""NVIDIA Nemotron-H (``nemotron_h``): blocks of one mixer each, after one RMSNorm and
before the residual add, named by ``layers_block_type``: Mamba2 (``linear_attention``,
its state per sequence in the recurrent-state cache, layers/mamba2.py), attention without
positions in q and k (``full_attention``, K/V in the paged cache, numbered among
themselves), or an MLP of squared ReLU (``mlp``). The mixture-of-experts blocks
(``moe``: squared-ReLU experts without a gate) are not built yet, and refused by name.

Tensor parallelism is not yet built for it.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from roseinfer.core import recurrent
from roseinfer.core.errors import ConfigError
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.mamba2 import Mamba2Mixer
from roseinfer.layers.norm import RMSNorm
from roseinfer.models.granite_hybrid import NoRotary
from roseinfer.models.llama import LlamaForCausalLM, self_attention


class SquaredReluMlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(h)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, cfg, kind: str, attn_idx: int):
        super().__init__()
        e = cfg.hidden_size
        self.norm = RMSNorm(e, cfg.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(
                e, cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.mamba_num_heads,
                cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel,
                cfg.layer_norm_epsilon, cfg.use_bias, cfg.use_conv_bias,
                (cfg.time_step_min, float("inf")))
        elif kind == "full_attention":
            h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            d = cfg.head_dim or e // h
            self.h, self.hkv, self.q_size, self.kv_size = h, hkv, h * d, hkv * d
            self.qkv_proj = nn.Linear(e, (h + 2 * hkv) * d, bias=False)
            self.o_proj = nn.Linear(h * d, e, bias=False)
            self.qk_norm, self.clip_qkv, self.rotary = False, None, NoRotary()
            self.attn = PagedAttention(attn_idx, h, hkv, d, d ** -0.5)
        elif kind == "mlp":
            self.mixer = SquaredReluMlp(e, cfg.intermediate_size, cfg.mlp_bias)
        else:
            raise ConfigError(f"nemotron_h: {kind!r} blocks are not built yet (its "
                              "mixture of experts); a model of mamba, attention and mlp "
                              "blocks runs")
        self.kind = kind

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        h, residual = self.norm(x, residual, summed=True)
        if self.kind == "full_attention":
            return self_attention(self, h, positions), residual
        return self.mixer(h), residual


class NemotronHForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg):
        recurrent.refuse_tensor_parallel("nemotron_h")
        nn.Module.__init__(self)
        from roseinfer.layers.embedding import LogitsHead, VocabEmbedding
        kinds = cfg.layers_block_type
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(cfg, kind, kinds[:i].count("full_attention"))
            for i, kind in enumerate(kinds))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.tied = bool(cfg.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head = LogitsHead(cfg.vocab_size)

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """transformers' names (``model.``) or checkpoints' (``backbone.``): the embedding
        and final norm renamed, attention's q/k/v fused."""
        out, qkv = {}, {}
        for key, t in sd.items():
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            key = re.sub(r"^(model|backbone)\.", "", key)
            key = {"embeddings.weight": "embed_tokens.weight",
                   "norm_f.weight": "norm.weight"}.get(key, key)
            m = re.fullmatch(r"(layers\.\d+\.)mixer\.(q|k|v)_proj\.weight", key)
            if m:
                qkv.setdefault(f"{m.group(1)}qkv_proj.weight", {})[m.group(2)] = t
                continue
            m = re.fullmatch(r"(layers\.\d+\.)mixer\.o_proj\.weight", key)
            out[f"{m.group(1)}o_proj.weight" if m else key] = t
        out.update({key: torch.cat([p["q"], p["k"], p["v"]]) for key, p in qkv.items()})
        return out
