"""Routers that choose experts otherwise than by a softmax's top k (layers/moe.py's).

``GroupedTopK``, DeepSeek-V3's ``noaux_tc`` (also Moonlight's, Kimi K2's and GLM-4.5's):
each expert's score is sigmoid(logit). Experts are chosen by score plus a learned
per-expert correction bias: the experts fall in ``groups`` equal groups, each group
scored by the sum of its two best, and only the best ``topk_groups`` groups' experts
compete for the top k. The chosen experts' weights are their scores without the bias,
normalised to sum to one (``renormalize``), times ``scale``. On CUDA one kernel does it
all, summing the split router GEMV's partials at decode sizes (``router_partials``): torch
takes about ten launches.

Both take ``(h, gate)``, as ``SparseMoE`` hands them over; ``select(logits)`` is the
routing alone."""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.layers.fused import _use_triton
from roseinfer.layers.moe import router_partials


@_kernel
def _grouped_route_kernel(logits_ptr, round_ptr, corr_ptr, weights_ptr, ids_ptr, experts,
                          per_group, s_l, s_part, parts, scale, GROUPS: tl.constexpr,
                          TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
                          RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_P: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
    """One token's ``GroupedTopK``: its logits the sum of ``parts`` partials ``s_part``
    apart, rounded to ``round_ptr``'s dtype with ``ROUND``; among equal scores the lower
    group, then the lower expert, first."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < experts
    ps = tl.arange(0, BLOCK_P)[:, None]
    x = tl.zeros([BLOCK_E], tl.float32)
    for p0 in range(0, parts, BLOCK_P):
        x += tl.sum(tl.load(logits_ptr + (p0 + ps) * s_part + token * s_l + cols[None, :],
                            mask=(p0 + ps < parts) & ok[None, :], other=0.0).to(tl.float32), 0)
    if ROUND:
        x = x.to(round_ptr.dtype.element_ty).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-x))
    corr = tl.load(corr_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    biased = tl.where(ok, scores + corr, float("-inf"))
    if TOPK_GROUPS < GROUPS:  # each group scored by its two best; the best groups kept
        gs = tl.arange(0, BLOCK_G)
        member = ((cols // per_group)[None, :] == gs[:, None]) & ok[None, :]
        in_group = tl.where(member, biased[None, :], float("-inf"))
        first = tl.argmax(in_group, 1, tie_break_left=True)
        second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), 1)
        group_score = tl.where(gs < GROUPS, tl.max(in_group, 1) + second, float("-inf"))
        kept = tl.zeros([BLOCK_G], tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.argmax(group_score, 0, tie_break_left=True)
            kept = tl.where(gs == best, 1, kept)
            group_score = tl.where(gs == best, float("-inf"), group_score)
        keep = tl.sum(tl.where(member, kept[:, None], 0), 0) > 0
        biased = tl.where(keep, biased, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(biased, 0, tie_break_left=True)
        chosen_id = tl.where(slots == j, best, chosen_id)
        chosen_w = tl.where(slots == j, tl.sum(tl.where(cols == best, scores, 0.0), 0), chosen_w)
        biased = tl.where(cols == best, float("-inf"), biased)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, 0) + 1e-20)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w * scale, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_id, mask=slots < TOP_K)


class GroupedTopK(nn.Module):
    def __init__(self, experts: int, top_k: int, groups: int, topk_groups: int, scale: float,
                 renormalize: bool):
        super().__init__()
        if experts % groups:
            raise ValueError(f"{experts} experts do not fall in {groups} equal groups (n_group)")
        self.top_k, self.groups, self.topk_groups = top_k, groups, topk_groups
        self.scale, self.renormalize = scale, renormalize
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, h: torch.Tensor, gate: nn.Linear,
                use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int32) of the tokens ``h``."""
        split = router_partials(h, gate, use_triton)
        if split is None:
            return self.select(gate(h), use_triton)
        partials, rounded_to = split
        return self._kernel(partials, h.shape[0], partials.shape[0], rounded_to)

    def select(self, logits: torch.Tensor,
               use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of the router's ``logits`` [T, E]."""
        if _use_triton(use_triton, logits):
            return self._kernel(logits.contiguous().unsqueeze(0), logits.shape[0], 1, None)
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

    def _kernel(self, logits: torch.Tensor, tokens: int, parts: int,
                rounded_to: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel over ``parts`` partial logits [parts, rows, E] of ``tokens`` tokens."""
        experts = logits.shape[-1]
        weights = torch.empty((tokens, self.top_k), dtype=torch.float32, device=logits.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int32, device=logits.device)
        if tokens:
            pdl = dependent_launch(logits.device, tokens)
            _grouped_route_kernel[(tokens,)](
                logits, logits if rounded_to is None else rounded_to,
                self.e_score_correction_bias, weights, ids, experts, experts // self.groups,
                logits.stride(1), logits.stride(0), parts, float(self.scale),
                GROUPS=self.groups, TOPK_GROUPS=self.topk_groups, TOP_K=self.top_k,
                RENORMALIZE=self.renormalize, BLOCK_E=triton.next_power_of_2(experts),
                BLOCK_G=triton.next_power_of_2(self.groups),
                BLOCK_K=triton.next_power_of_2(self.top_k),
                BLOCK_P=min(16, triton.next_power_of_2(parts)), ROUND=rounded_to is not None,
                PDL=pdl, num_warps=4, launch_pdl=pdl)
        return weights, ids


class GroupLimitedSoftmax(nn.Module):
    """DeepSeek-V2's routing: softmax probabilities; with ``groups``
    (``group_limited_greedy``) only the experts of the ``topk_groups`` groups whose best
    probability is highest compete; the top k's probabilities, not renormalised, times
    ``scale``."""

    def __init__(self, top_k: int, scale: float, groups: int | None = None,
                 topk_groups: int | None = None):
        super().__init__()
        self.top_k, self.scale, self.groups, self.topk_groups = top_k, scale, groups, topk_groups

    def forward(self, h: torch.Tensor, gate: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(gate(h))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.float().softmax(-1)
        if self.groups:
            per_group = probs.view(probs.shape[0], self.groups, -1)
            best = per_group.max(-1).values.topk(self.topk_groups, dim=-1)[1]
            kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
            probs = per_group.masked_fill(~kept[..., None], 0.0).flatten(1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights * self.scale, ids.to(torch.int32)
