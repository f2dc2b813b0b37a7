"""Routers that choose experts otherwise than by a softmax's top k (layers/moe.py's).

``GroupedTopK``, DeepSeek-V3's ``noaux_tc`` (also Moonlight's, Kimi K2's and GLM-4.5's):
each expert's score is sigmoid(logit). Experts are chosen by score plus a learned
per-expert correction bias: the experts fall in ``groups`` equal groups, each group
scored by the sum of its two best, and only the best ``topk_groups`` groups' experts
compete for the top k. The chosen experts' weights are their scores without the bias,
normalised to sum to one (``renormalize``), times ``scale``."""
from __future__ import annotations

import torch
from torch import nn


class GroupedTopK(nn.Module):
    def __init__(self, experts: int, top_k: int, groups: int, topk_groups: int, scale: float,
                 renormalize: bool):
        super().__init__()
        if experts % groups:
            raise ValueError(f"{experts} experts do not fall in {groups} equal groups (n_group)")
        self.top_k, self.groups, self.topk_groups = top_k, groups, topk_groups
        self.scale, self.renormalize = scale, renormalize
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int32)."""
        scores = logits.float().sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        per_group = biased.view(scores.shape[0], self.groups, -1)
        best_groups = per_group.topk(2, dim=-1)[0].sum(-1).topk(self.topk_groups, dim=-1)[1]
        kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        biased = per_group.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids.to(torch.int32)


class GroupLimitedSoftmax(nn.Module):
    """DeepSeek-V2's routing: softmax probabilities; with ``groups``
    (``group_limited_greedy``) only the experts of the ``topk_groups`` groups whose best
    probability is highest compete; the top k's probabilities, not renormalised, times
    ``scale``."""

    def __init__(self, top_k: int, scale: float, groups: int | None = None,
                 topk_groups: int | None = None):
        super().__init__()
        self.top_k, self.scale, self.groups, self.topk_groups = top_k, scale, groups, topk_groups

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.float().softmax(-1)
        if self.groups:
            per_group = probs.view(probs.shape[0], self.groups, -1)
            best = per_group.max(-1).values.topk(self.topk_groups, dim=-1)[1]
            kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
            probs = per_group.masked_fill(~kept[..., None], 0.0).flatten(1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights * self.scale, ids.to(torch.int32)
