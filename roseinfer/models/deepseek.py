"""DeepSeek-V2 and V3 (and R1, V3.1, Moonlight, and Kimi K2 where its config says
deepseek_v3): multi-head latent attention (layers/mla.py) and DeepSeekMoE.

Its first ``first_k_dense_replace`` layers keep a dense SwiGLU MLP; the others route each
token to ``num_experts_per_tok`` of ``n_routed_experts`` experts (layers/moe_routing.py:
V3's grouped, biased sigmoid scores; V2's softmax, greedy or group-limited), beside shared
experts every token goes through (one SwiGLU MLP of ``n_shared_experts`` experts' width,
ungated). Checkpoints' names are transformers' (``self_attn.kv_b_proj`` is split into the
absorbed ``w_uk`` and ``w_uv`` at load)."""
from __future__ import annotations

import re

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.fused import silu_and_mul
from roseinfer.layers.mla import MultiLatentAttention, rope_halves
from roseinfer.layers.moe import SparseMoE
from roseinfer.layers.moe_routing import GroupedTopK, GroupLimitedSoftmax
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding
from roseinfer.models import sharding
from roseinfer.models.llama import LlamaForCausalLM, LlamaLayer
from roseinfer.models.moe import MoeForCausalLM
from roseinfer.models.mtp import mtp_part

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class SwiGLU(nn.Module):
    """A dense layer's MLP, or the shared experts: this rank's intermediate rows, its part
    of the output (the next norm sums the ranks')."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        intermediate = tp.split(intermediate, "intermediate size")
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(h)))


class DeepseekLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        e = cfg.hidden_size
        self.input_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(e, cfg.rms_norm_eps)
        self.self_attn = MultiLatentAttention(cfg, layer_idx, rotary)
        self.moe = self.shared_experts = None
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp = SwiGLU(e, cfg.intermediate_size)
            return
        self.moe = SparseMoE(e, cfg.moe_intermediate_size, cfg.n_routed_experts,
                             cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                             routing=routing(cfg))
        if cfg.n_shared_experts:
            self.shared_experts = SwiGLU(e, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        """(this rank's part of the layer's output, the residual stream before it), as
        LlamaLayer's: each norm sums the ranks' parts of what it is handed."""
        h, residual = self.input_layernorm(x, residual, summed=residual is None)
        attn = self.self_attn(h, positions)
        h, residual = self.post_attention_layernorm(attn, residual, summed=False)
        if self.moe is None:
            return self.mlp(h), residual
        out = self.moe(h)
        return (out if self.shared_experts is None else out + self.shared_experts(h)), residual


def routing(cfg) -> nn.Module | None:
    """V3's grouped, biased sigmoid scores; V2's softmax, greedy or group-limited. V2's
    greedy routing unscaled (V2-Lite's) is every MoE family's softmax top-k without
    renormalising: None, the fused router and routing kernels (V2 never renormalises,
    whatever ``norm_topk_prob`` says)."""
    if cfg.model_type == "deepseek_v2":
        grouped = cfg.topk_method == "group_limited_greedy"
        if not grouped and cfg.routed_scaling_factor == 1.0 and not cfg.norm_topk_prob:
            return None
        return GroupLimitedSoftmax(cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                   cfg.n_group if grouped else None, cfg.topk_group)
    return GroupedTopK(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                       cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)


class Glm4MoeLayer(LlamaLayer):
    """GLM-4.5's: Llama's attention (q/k/v biases, an o_proj without one, per-head q/k norms
    where ``use_qk_norm``, partial rotary) and DeepSeekMoE past the first
    ``first_k_dense_replace`` layers."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rotary)
        self.o_proj = nn.Linear(self.o_proj.in_features, self.o_proj.out_features, bias=False)
        if getattr(cfg, "use_qk_norm", False):
            d = self.q_size // self.h
            self.qk_norm = True
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def init_mlp(self, cfg, layer_idx: int) -> None:
        self.moe = self.shared_experts = None
        if layer_idx < cfg.first_k_dense_replace:
            return super().init_mlp(cfg, layer_idx)
        self.moe = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                             cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                             routing=routing(cfg))
        self.shared_experts = SwiGLU(cfg.hidden_size,
                                     cfg.moe_intermediate_size * cfg.n_shared_experts)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().mlp(h)
        return self.moe(h) + self.shared_experts(h)


class DeepseekForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekLayer

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The attention's weights as they are (``kv_b_proj`` split into ``w_uk`` and
        ``w_uv``, interleaved RoPE rows to halves); the rest as the MoE families convert
        it (experts stacked, the router as ``moe.gate``, gate/up fused), with the
        routing's correction bias into ``moe.routing`` and dense layers' MLP into ``mlp``."""
        sd = _without_mtp(sd, cfg)
        out = {}
        for key, t in sd.items():
            if ".self_attn." in key:
                out.update(_attention(key.removeprefix("model."), t, cfg))
        rest = {k: t for k, t in sd.items() if ".self_attn." not in k}
        for key, t in MoeForCausalLM.convert_hf_state_dict(rest, cfg).items():
            *path, name, kind = key.split(".")
            prefix = ".".join(path)
            if kind == "e_score_correction_bias":
                out[f"{prefix}.moe.routing.e_score_correction_bias"] = t
            elif name in ("gate_up_proj", "down_proj") and len(path) == 2:
                out[f"{prefix}.mlp.{name}.{kind}"] = t  # a dense layer's (Llama's drops mlp.)
            else:
                out[key] = t
        return out

    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """Latent attention by head: the query's and the values' up-projections, and
        o_proj's inputs; the latent's down-projection and norms whole (each rank keeps the
        whole latent cache, one KV head). The MLPs as the MoE families' and GLM's."""
        if ".self_attn." not in key:
            return Glm4MoeForCausalLM.shard_rule(key, cfg)
        name, kind = key.split(".")[-2:]
        h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        if name in ("q_proj", "q_b_proj"):
            return sharding.heads(h, nope + cfg.qk_rope_head_dim)
        if name == "kv_b_proj":
            return sharding.heads(h, nope + v)
        if name == "o_proj":
            return sharding.Shard(0, once=True) if kind == "bias" else \
                sharding.Shard(1, sharding.heads(h, v).ranges)
        return None


class Glm4MoeForCausalLM(LlamaForCausalLM):
    layer_class = Glm4MoeLayer

    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """The MoE families' rule, the shared experts' rows split as a dense MLP's."""
        if ".shared_experts." not in key:
            return MoeForCausalLM.shard_rule(key, cfg)
        mlp = sharding.split(cfg.moe_intermediate_size * cfg.n_shared_experts,
                             "intermediate size")
        name = key.split(".")[-2]
        return sharding.Shard(1, mlp.ranges) if name == "down_proj" else mlp

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The MoE families' conversion, the routing's correction bias into
        ``moe.routing``."""
        out = MoeForCausalLM.convert_hf_state_dict(_without_mtp(sd, cfg), cfg)
        return {k.replace(".gate.e_score_correction_bias", ".moe.routing.e_score_correction_bias"):
                t for k, t in out.items()}


def _without_mtp(sd: dict, cfg) -> dict:
    """The checkpoint less its multi-token-prediction layers (numbered from
    ``num_hidden_layers``), which only a draft would run."""
    def layer(key):
        m = _LAYER.match(key)
        return int(m[1]) if m else -1
    return {k: t for k, t in sd.items() if layer(k) < cfg.num_hidden_layers}


def _attention(key: str, t: torch.Tensor, cfg) -> dict:
    *path, name, kind = key.split(".")
    prefix = ".".join(path)
    if name != "kv_b_proj":
        return {key: _rope_rows(name, t, cfg)}
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    w = t.view(-1, nope + v, cfg.kv_lora_rank)
    return {f"{prefix}.w_uk": w[:, :nope].contiguous(), f"{prefix}.w_uv": w[:, nope:].contiguous()}


def _rope_rows(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """Interleaved RoPE rows to halves (layers/mla.py ``rope_halves``): the queries' in
    q_proj or q_b_proj, the shared key's in kv_a_proj_with_mqa."""
    if not (cfg.model_type == "deepseek_v2" or getattr(cfg, "rope_interleave", False)):
        return t  # V2's RoPE is always interleaved (complex pairs)
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if name in ("q_proj", "q_b_proj"):
        return rope_halves(t, nope, nope + rope, rope)
    if name == "kv_a_proj_with_mqa":
        return rope_halves(t, cfg.kv_lora_rank, t.shape[0], rope)
    return t


# The modules their checkpoints hold beside the model, which loader.load(part=...) builds.
DeepseekForCausalLM.parts = {"mtp": mtp_part(DeepseekForCausalLM)}
Glm4MoeForCausalLM.parts = {"mtp": mtp_part(Glm4MoeForCausalLM)}
