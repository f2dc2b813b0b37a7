"""Llama-like families whose MLPs are mixtures of experts, on the paged KV cache: Llama's
attention (Qwen3-MoE's with an RMSNorm on each head of q and k) and in each sparse layer
a router over SwiGLU experts, each token through its top k (layers/moe.py).

- ``qwen3_moe``: ``num_experts`` of ``moe_intermediate_size``, ``norm_topk_prob``; layers
  in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP.
- ``mixtral``: ``num_local_experts`` of ``intermediate_size`` in every layer, the top-k
  weights renormalised; its sliding window is Mistral's (device_side._context_len).
"""
from __future__ import annotations

import re

import torch

from roseinfer.layers.moe import SparseMoE
from roseinfer.models.llama import LlamaForCausalLM, LlamaLayer

# The experts' tensors in a checkpoint: stacked, as transformers holds them in memory
# (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), or one per expert, as
# checkpoints on disk hold them (``mlp.experts.E.gate_proj.weight``; Mixtral's
# ``block_sparse_moe.experts.E.w1.weight``, w1 the gate, w3 the up, w2 the down).
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(gate\.weight|experts\..+)")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}


def experts_of(cfg, layer_idx: int) -> SparseMoE | None:
    """The layer's mixture of experts; None where it keeps a dense MLP."""
    if cfg.model_type == "mixtral":
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                         cfg.num_experts_per_tok, renormalize=True)
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    if (layer_idx in (getattr(cfg, "mlp_only_layers", None) or []) or cfg.num_experts == 0
            or (layer_idx + 1) % step):
        return None
    return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                     cfg.num_experts_per_tok, cfg.norm_topk_prob)


class MoeLayer(LlamaLayer):
    def init_mlp(self, cfg, layer_idx: int) -> None:
        self.moe = experts_of(cfg, layer_idx)
        if self.moe is None:
            super().init_mlp(cfg, layer_idx)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return super().mlp(h) if self.moe is None else self.moe(h)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeLayer

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
            else:  # experts.E.PROJ.weight
                _, expert, proj, _ = name.split(".")
                per_expert.setdefault(prefix, {}).setdefault(_PROJ[proj], {})[int(expert)] = t
        for prefix, projs in per_expert.items():
            experts = sorted(projs["down"])
            out[prefix + "w2"] = torch.stack([projs["down"][e] for e in experts])
            out[prefix + "w13"] = torch.stack([torch.cat([projs["gate"][e], projs["up"][e]])
                                               for e in experts])
        return {**LlamaForCausalLM.convert_hf_state_dict(dense, cfg), **out}
