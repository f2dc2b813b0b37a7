"""Llama-like families whose MLPs are mixtures of experts, on the paged KV cache: Llama's
attention (with each family's q/k norms, llama.py) and in each sparse layer a router over
SwiGLU experts, each token through its top k (layers/moe.py).

- ``qwen3_moe``: ``num_experts`` of ``moe_intermediate_size``, ``norm_topk_prob``; layers
  in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP.
- ``qwen2_moe``: Qwen3-MoE's layout, with q/k/v biases and no q/k norms, and beside the
  routed experts a shared one every token goes through, scaled by a sigmoid gate.
- ``mixtral``: ``num_local_experts`` of ``intermediate_size`` in every layer, the top-k
  weights renormalised; a sliding window as Mistral's.
- ``olmoe``: ``num_experts`` of ``intermediate_size`` in every layer; q and k normed
  across all heads.
- ``gpt_oss``: ``num_local_experts`` of ``intermediate_size`` in every layer, with biases
  on the router and the experts, and a clamped SwiGLU (layers/moe.py ``ClampedGlu``);
  attention with biases and sinks, its window layers alternating with full ones. Its
  checkpoints hold gate_up as [E, H, 2I] with gate and up columns interleaved.

Under tensor parallelism each expert's intermediate rows split over the ranks, as a dense
MLP's do; with ``enable_expert_parallel``, the experts do, whole (``shard_rule``).
"""
from __future__ import annotations

import re

import torch

from roseinfer.core import tp
from roseinfer.core.errors import ConfigError
from roseinfer.layers.moe import ClampedGlu, SharedExpert, SparseMoE
from roseinfer.models import sharding
from roseinfer.models.llama import LlamaForCausalLM, LlamaLayer, heads_of

# The experts' tensors in a checkpoint: stacked, as transformers holds them in memory
# (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), or one per expert, as
# checkpoints on disk hold them (``mlp.experts.E.gate_proj.weight``; Mixtral's
# ``block_sparse_moe.experts.E.w1.weight``, w1 the gate, w3 the up, w2 the down).
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(gate\.weight|router\.weight|router\.bias|experts\..+)")
# Every layer sparse, each expert of intermediate_size.
_EVERY_LAYER = ("mixtral", "olmoe", "gpt_oss")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}


def gpt_oss_glu(cfg) -> ClampedGlu:
    """gpt-oss's clamped SwiGLU: config fields in newer transformers, constants before."""
    return ClampedGlu(getattr(cfg, "swiglu_alpha", 1.702), getattr(cfg, "swiglu_limit", 7.0))


def expert_width(cfg) -> int:
    """Each routed expert's intermediate size."""
    every_layer = cfg.model_type in _EVERY_LAYER
    return cfg.intermediate_size if every_layer else cfg.moe_intermediate_size


def num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts


def experts_of(cfg, layer_idx: int) -> SparseMoE | None:
    """The layer's mixture of experts; None where it keeps a dense MLP."""
    experts = num_experts(cfg)
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    if (layer_idx in (getattr(cfg, "mlp_only_layers", None) or []) or experts == 0
            or (layer_idx + 1) % step):
        return None
    gpt_oss = cfg.model_type == "gpt_oss"  # softmax over the top k: renormalised
    return SparseMoE(cfg.hidden_size, expert_width(cfg), experts, cfg.num_experts_per_tok,
                     renormalize=getattr(cfg, "norm_topk_prob", True), bias=gpt_oss,
                     glu=gpt_oss_glu(cfg) if gpt_oss else None)


class MoeLayer(LlamaLayer):
    def init_mlp(self, cfg, layer_idx: int) -> None:
        self.moe = experts_of(cfg, layer_idx)
        if self.moe is None:
            super().init_mlp(cfg, layer_idx)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        self.shared_expert = SharedExpert(cfg.hidden_size, shared) if (
            self.moe is not None and shared) else None

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().mlp(h)
        out = self.moe(h)
        return out if self.shared_expert is None else out + self.shared_expert(h)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeLayer

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The experts stacked into ``moe.w13`` ([E, 2I, H], gate rows then up) and
        ``moe.w2``; the rest as Llama's."""
        dense, out, per_expert = {}, {}, {}
        for key, t in sd.items():
            m = _EXPERT.fullmatch(key)
            if m is None:  # Qwen2-MoE's shared expert gate joins its expert's module
                dense[key.replace(".shared_expert_gate.", ".shared_expert.gate.")] = t
                continue
            layer, name = m.groups()
            prefix = f"layers.{layer}.moe."
            if name in ("gate.weight", "router.weight", "router.bias"):
                out[prefix + "gate." + name.split(".")[1]] = t
            elif cfg.model_type == "gpt_oss":
                out.update(_gpt_oss_experts(prefix, name, t))
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
        dense = LlamaForCausalLM.convert_hf_state_dict(dense, cfg)
        sinks = {k.replace(".sinks", ".attn.sinks"): dense.pop(k) for k in list(dense)
                 if k.endswith(".sinks")}
        return {**dense, **sinks, **out}

    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """Llama's, with each expert's intermediate rows split as a dense MLP's are (the
        router and the shared expert's gate whole), or under expert parallelism each
        rank's experts whole; OLMoE's q/k norms by head."""
        routed, shared = ".experts." in key, ".shared_expert." in key
        if routed and tp.group().expert_parallel:
            return _expert_shard(key, cfg)
        if cfg.model_type == "gpt_oss" and (routed or key.endswith(".sinks")):
            return _gpt_oss_shard(key, cfg)
        if routed or shared:
            width = cfg.shared_expert_intermediate_size if shared else expert_width(cfg)
            mlp = sharding.split(width, "expert intermediate size")
            per_expert = key.endswith(".weight")  # stacked tensors have no .weight
            name = key.split(".")[-2 if per_expert else -1]
            if name in ("gate_proj", "up_proj", "w1", "w3"):
                return mlp
            if name in ("down_proj", "w2"):
                return sharding.Shard(1 if per_expert else 2, mlp.ranges)
            if name == "gate_up_proj":
                return sharding.joined(1, mlp, mlp, offsets=(0, width))
        if cfg.model_type == "olmoe" and key.endswith(("q_norm.weight", "k_norm.weight")):
            h, hkv, d = heads_of(cfg)
            return sharding.heads(h, d) if "q_norm" in key else sharding.kv_heads(hkv, d)
        return LlamaForCausalLM.shard_rule(key, cfg)


def _gpt_oss_experts(prefix: str, name: str, t: torch.Tensor) -> dict:
    """gpt-oss's stacked experts as w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I] and
    their biases; its gate_up is [E, H, 2I], gate and up columns interleaved."""
    def split(x):  # interleaved gate, up -> gate then up
        return torch.cat([x[..., ::2], x[..., 1::2]], dim=-1)
    kind = name.removeprefix("experts.")
    if kind == "gate_up_proj":
        return {prefix + "w13": split(t).transpose(1, 2).contiguous()}
    if kind == "down_proj":
        return {prefix + "w2": t.transpose(1, 2).contiguous()}
    if kind == "gate_up_proj_bias":
        return {prefix + "b13": split(t)}
    if kind == "down_proj_bias":
        return {prefix + "b2": t}
    raise ConfigError(f"gpt_oss: no expert tensor {name!r}; an MXFP4 checkpoint's blocks and "
                      "scales are read where its config.json has quantization_config "
                      "{\"quant_method\": \"mxfp4\"}")


def _expert_shard(key: str, cfg) -> sharding.Shard | None:
    """Under expert parallelism, this rank's experts whole: its rows of a stacked tensor
    ([E, ...]), or a per-expert tensor if the expert is its own, else none of it."""
    mine = sharding.experts(num_experts(cfg))
    m = re.search(r"\.experts\.(\d+)\.", key)
    if m is None:
        return sharding.rows(mine.start, len(mine))
    return None if int(m.group(1)) in mine else sharding.ABSENT


def _gpt_oss_shard(key: str, cfg) -> sharding.Shard | None:
    """gpt-oss's experts split by intermediate rows: an interleaved gate/up pair per row,
    so a rank's share of gate_up is one run of 2 * I / ranks columns."""
    if key.endswith(".sinks"):
        return sharding.heads(cfg.num_attention_heads, 1)
    mlp = sharding.split(cfg.intermediate_size, "expert intermediate size")
    (lo, hi), = mlp.ranges
    kind = key.rsplit(".", 1)[1]
    if kind in ("gate_up_proj", "gate_up_proj_bias"):
        return sharding.Shard(2 if kind == "gate_up_proj" else 1, ((2 * lo, 2 * hi),))
    if kind == "down_proj":
        return sharding.Shard(1, mlp.ranges)
    return sharding.Shard(0, once=True)  # down_proj_bias: the ranks' outputs are summed
