"""DeepSeek-V3's multi-token-prediction (MTP) module, as a model of its own: what the
``mtp`` proposer (plugins/speculative/mtp.py) runs beside the model that it drafts for.

The checkpoint keeps it as the layer after the last one (``model.layers.{L}``, L =
``num_hidden_layers``; GLM-4.5's the same). At position i it takes the model's final
hidden state h_i (after the final norm) and the embedding of the token after i, and
predicts the token after that (the DeepSeek-V3 report, section 2.2):

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])
    o_i = block(x_i)                        # one decoder layer of the family's own
    logits_{i+2} = head(shared_head.norm(o_i))

The embedding and the head are the model's (the report: shared); the checkpoint's
copies of them are not loaded. Its decoder layer is the family's layer at index L, so a
DeepSeek checkpoint's MTP block is a MoE layer with latent attention, as the checkpoint
holds it. Its attention keeps a paged cache of its own, one layer (index 0 there),
over the same block ids as the model's: position i's rows sit where the model's do.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.norm import RMSNorm

_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head")  # the module's own, beside its block
_SHARED = ("embed_tokens", "shared_head.head")  # the model's, which the module reads


def mtp_part(family):
    """The MTP module class of a family whose checkpoints hold one after their last layer
    (DeepSeek-V3's, GLM-4.5's): ``family.layer_class`` is its block."""

    class MultiTokenPredictor(_MultiTokenPredictor):
        layer_class = family.layer_class
        convert_block = staticmethod(family.convert_hf_state_dict)
        rotaries = staticmethod(family.rotaries)

    MultiTokenPredictor.__qualname__ = f"{family.__name__}.MultiTokenPredictor"
    return MultiTokenPredictor


class _MultiTokenPredictor(nn.Module):
    layer_class: type
    convert_block = rotaries = None

    def __init__(self, cfg):
        super().__init__()
        if not getattr(cfg, "num_nextn_predict_layers", 0):
            raise ValueError("this checkpoint has no multi-token-prediction layer "
                             "(num_nextn_predict_layers is 0): speculate with ngram or a "
                             "draft model instead")
        e, last = cfg.hidden_size, cfg.num_hidden_layers
        self.enorm = RMSNorm(e, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(e, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * e, e, bias=False)
        self.block = self.layer_class(cfg, last, self.rotaries(cfg)[-1])
        for m in self.block.modules():  # the one layer of its own cache
            if isinstance(m, PagedAttention):
                m.layer_idx = 0
        self.norm = RMSNorm(e, cfg.rms_norm_eps)  # the checkpoint's shared_head.norm
        self.shared = None  # the model's embedding and head (share), not submodules here

    def share(self, model: nn.Module) -> None:
        """Read ``model``'s embedding and LM head (the checkpoint's copies are the same)."""
        self.shared = (model.embed, model.head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared[1](hidden)

    def bind_head(self) -> None:
        """Nothing to bind: the head is the model's (``share``)."""

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Each position's hidden state for the token after next, normed for the head;
        ``ids``: the token after each position, ``hidden``: the model's final hidden
        states there."""
        x = torch.cat([self.enorm(self.shared[0](ids))[0], self.hnorm(hidden)[0]], -1)
        out, residual = self.block(self.eh_proj(x), None, positions)
        return self.norm(out, residual, summed=False)[0]

    @staticmethod
    def checkpoint_keys(key: str, cfg) -> bool:
        """Whether the checkpoint's tensor ``key`` is the first MTP layer's own."""
        m = re.match(r"(?:model\.)?layers\.(\d+)\.(.*)", key)
        return bool(m) and int(m[1]) == cfg.num_hidden_layers and \
            not m[2].startswith(_SHARED)

    @classmethod
    def convert_hf_state_dict(cls, sd: dict, cfg) -> dict:
        """The layer's tensors: its norms and projection by name, its block as the family
        converts a layer of its own (experts stacked, kv_b_proj split, ...)."""
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        own, block = {}, {}
        for key, t in sd.items():
            name = key.removeprefix(prefix)
            if name.startswith(_SHARED):
                continue
            if name.startswith(_NAMES):
                own[name.replace("shared_head.", "")] = t
            else:
                block[f"model.layers.0.{name}"] = t
        for key, t in cls.convert_block(block, cfg).items():
            own["block." + key.removeprefix("layers.0.")] = t
        return own
