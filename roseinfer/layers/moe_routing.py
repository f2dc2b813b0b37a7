"""Routers: each token's experts and their weights, from the router linear's logits.

- ``route`` / ``select_experts``: softmax, top-k, and the renormalisation a family asks
  for (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE and OLMoE do not; a softmax over the
  top-k logits, gpt-oss's, is the renormalised form). At decode sizes on CUDA the
  router's GEMV runs split over the hidden dims (``router_partials``) and one routing
  kernel sums the partials.
- ``GroupedTopK``, DeepSeek-V3's ``noaux_tc`` (also Moonlight's, Kimi K2's and GLM-4.5's):
  each expert's score is sigmoid(logit). Experts are chosen by score plus a learned
  per-expert correction bias: the experts fall in ``groups`` equal groups, each group
  scored by the sum of its two best, and only the best ``topk_groups`` groups' experts
  compete for the top k. The chosen experts' weights are their scores without the bias,
  normalised to sum to one (``renormalize``), times ``scale``. On CUDA one kernel does it
  all, summing the split router GEMV's partials at decode sizes: torch takes about ten
  launches.
- ``GroupLimitedSoftmax``, DeepSeek-V2's.

The last two are modules ``SparseMoE`` takes as its ``routing``: they take ``(h,
gate)``; ``select(logits)`` is the routing alone."""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.layers.fused import _use_triton


@_kernel
def _router_kernel(x_ptr, w_ptr, part_ptr, tokens, experts, hidden, s_x, s_w,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    """The router's logits over one slice of the hidden dims, for up to 16 tokens: program
    (slice, expert block) stores x[:, slice] @ w[experts, slice].T as float32 partials
    [slices, 16, experts], which the routing kernel sums."""
    wait_for_inputs(PDL)
    part = tl.program_id(0)
    rows = tl.arange(0, 16)
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = part * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :],
                mask=(rows < tokens)[:, None] & (ks < hidden)[None, :], other=0.0)
    w = tl.load(w_ptr + es[:, None] * s_w + ks[None, :],
                mask=(es < experts)[:, None] & (ks < hidden)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(part_ptr + (part * 16 + rows[:, None]) * experts + es[None, :], acc,
             mask=(es < experts)[None, :])


@_kernel
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, experts, s_l, s_part, parts,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr, BLOCK_P: tl.constexpr = 1,
                  HAS_BIAS: tl.constexpr = False, ROUND: tl.constexpr = False):
    """One token's softmax over its router logits, its top k (the larger first, the lower
    expert first on ties), renormalised where asked. The logits are the sum of ``parts``
    partials ``s_part`` apart (one, where they come whole); with ``HAS_BIAS`` plus the
    router's bias, and with ``ROUND`` rounded to the bias's dtype, as the unfused linear's
    output is."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ps = tl.arange(0, BLOCK_P)[:, None]  # the partials in one load, summed across
    x = tl.sum(tl.load(logits_ptr + ps * s_part + token * s_l + cols[None, :],
                       mask=(ps < parts) & (cols < experts)[None, :], other=0.0
                       ).to(tl.float32), 0)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=cols < experts, other=0.0).to(tl.float32)
    if ROUND:
        x = x.to(bias_ptr.dtype.element_ty).to(tl.float32)
    x = tl.where(cols < experts, x, -float("inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(cols < experts, p / tl.sum(p, 0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 0, tie_break_left=True)
        chosen_w = tl.where(slots == j, tl.max(p, 0), chosen_w)
        chosen_id = tl.where(slots == j, best, chosen_id)
        p = tl.where(cols == best, -2.0, p)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) of each token's top-k experts by
    softmax probability; ``renormalize``: the k weights sum to one. One launch on CUDA
    where torch takes five. Among equal probabilities the kernel takes the lower expert
    first; torch.topk's order among them is its own (tests/test_moe.py)."""
    if _use_triton(use_triton, router_logits):
        return _routed(router_logits, router_logits.shape[0], router_logits.stride(0), 0, 1,
                       top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


ROUTER_SLICE = 64  # hidden dims a router program reads: 32 programs over 2,048


def route(h: torch.Tensor, gate: nn.Linear, top_k: int, renormalize: bool,
          use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` of the router ``gate``'s logits of ``h``. At decode sizes on CUDA
    the router's GEMV runs split over the hidden dims, across SMs, and the routing kernel
    sums its partials, adds the bias and rounds as the linear would: one of cuBLAS's GEMV
    kernels took 7.7 µs for the 0.5 MB of Qwen3-30B-A3B's router (docs/benchmarks.md)."""
    split = router_partials(h, gate, use_triton)
    if split is None:
        return select_experts(gate(h), top_k, renormalize, use_triton)
    partials, rounded_to = split
    return _routed(partials, h.shape[0], partials.shape[2], partials[0].numel(),
                   partials.shape[0], top_k, renormalize, rounded_to,
                   has_bias=gate.bias is not None)


def router_partials(h: torch.Tensor, gate: nn.Linear, use_triton: bool | None = None):
    """The router's logits of up to 16 tokens as float32 partials over slices of the hidden
    dims ([slices, 16, experts]), for a routing kernel to sum, and what it rounds their sum
    to (the router's bias, or its weight: the dtype the unfused linear outputs); None where
    the split GEMV does not run (off CUDA, prompts, a quantized router)."""
    tokens, hidden = h.shape
    w = getattr(gate, "weight", None)  # a plain linear's, at the activations' precision
    if not (_use_triton(use_triton, h) and 0 < tokens <= 16 and h.stride(1) == 1
            and isinstance(w, torch.Tensor) and w.dtype == h.dtype and w.stride(1) == 1):
        return None
    experts = w.shape[0]
    block_e = min(128, triton.next_power_of_2(experts))
    parts = triton.cdiv(hidden, ROUTER_SLICE)
    partials = torch.empty((parts, 16, experts), dtype=torch.float32, device=h.device)
    pdl = dependent_launch(h.device, tokens)
    _router_kernel[(parts, triton.cdiv(experts, block_e))](
        h, w, partials, tokens, experts, hidden, h.stride(0), w.stride(0),
        BLOCK_E=block_e, BLOCK_K=ROUTER_SLICE,
        PRECISION="ieee" if h.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return partials, w if gate.bias is None else gate.bias


def _routed(logits, tokens, s_l, s_part, parts, top_k, renormalize, rounded_to=None,
            has_bias=False):
    """The routing kernel over the sum of ``parts`` partial logits; ``rounded_to`` (the
    router's bias, or a tensor of its dtype where ``has_bias`` is off): the sum is rounded
    to its dtype."""
    experts = logits.shape[-1]
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:  # one warp: a row of logits is a few registers per thread (partials: four)
        pdl = dependent_launch(logits.device, tokens)
        _route_kernel[(tokens,)](logits, logits if rounded_to is None else rounded_to,
                                 weights, ids, experts, s_l, s_part, parts, TOP_K=top_k,
                                 RENORMALIZE=renormalize,
                                 BLOCK_E=triton.next_power_of_2(experts),
                                 BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl,
                                 BLOCK_P=triton.next_power_of_2(parts), HAS_BIAS=has_bias,
                                 ROUND=rounded_to is not None,
                                 num_warps=1 if parts == 1 else 4, launch_pdl=pdl)
    return weights, ids


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
