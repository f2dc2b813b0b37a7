"""Qwen3-MoE on the paged KV cache: Qwen3's attention (an RMSNorm on each head of q and k),
and in each sparse layer a router over ``num_experts`` SwiGLU experts, each token through
its ``num_experts_per_tok`` (layers/moe.py); layers listed in ``mlp_only_layers``, or
off the ``decoder_sparse_step`` grid, keep a dense MLP."""
from __future__ import annotations

import re

import torch

from roseinfer.layers.moe import SparseMoE
from roseinfer.models.llama import LlamaForCausalLM, LlamaLayer

# The experts' tensors in a checkpoint: stacked, as transformers holds them in memory
# (``experts.gate_up_proj``, ``experts.down_proj``), or one per expert, as checkpoints
# on disk hold them (``experts.E.gate_proj.weight`` ...).
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.(gate\.weight|experts\..+)")


def is_sparse(cfg, layer_idx: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeLayer(LlamaLayer):
    def init_mlp(self, cfg, layer_idx: int) -> None:
        self.moe = None
        if not is_sparse(cfg, layer_idx):
            return super().init_mlp(cfg, layer_idx)
        self.moe = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                             cfg.num_experts_per_tok, cfg.norm_topk_prob)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return super().mlp(h) if self.moe is None else self.moe(h)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoeLayer

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The experts stacked into ``moe.w13`` ([E, 2I, H], gate rows then up) and
        ``moe.w2``; the rest as Llama's."""
        dense, out, per_expert = {}, {}, {}
        for key, t in sd.items():
            m = _EXPERT.fullmatch(key)
            if m is None:
                dense[key] = t
                continue
            layer, name = m.groups()
            prefix = f"layers.{layer}.moe."
            if name == "gate.weight":
                out[prefix + "gate.weight"] = t
            elif name in ("experts.gate_up_proj", "experts.down_proj"):
                out[prefix + ("w13" if name.endswith("gate_up_proj") else "w2")] = t
            else:  # experts.E.{gate,up,down}_proj.weight
                _, expert, proj, _ = name.split(".")
                per_expert.setdefault((prefix, proj), {})[int(expert)] = t
        for (prefix, proj), by_expert in per_expert.items():
            if proj == "down_proj":
                out[prefix + "w2"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
        for (prefix, proj), by_expert in per_expert.items():
            if proj == "gate_proj":
                up = per_expert[(prefix, "up_proj")]
                out[prefix + "w13"] = torch.stack([torch.cat([by_expert[e], up[e]])
                                                   for e in sorted(by_expert)])
        return {**LlamaForCausalLM.convert_hf_state_dict(dense, cfg), **out}
