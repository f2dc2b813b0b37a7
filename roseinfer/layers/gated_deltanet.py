"""Gated DeltaNet, Qwen3-Next's linear attention, each sequence carrying its state from
step to step (core/recurrent.py): the last ``kernel - 1`` inputs of its causal convolution
over q, k and v, and per value head a [key dim, value dim] matrix in float32.

Per token, after the convolution and SiLU, with q and k L2-normalised (q also scaled by
1 / sqrt(key dim)) and each key head serving ``value heads / key heads`` value heads:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

with ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; then an RMSNorm of
each head's output gated by SiLU(z), and out_proj. Every decoding sequence of a step runs
in one batch, which on a GPU steps each state in its row (layers/recurrent_decode.py). A
prompt's chunk runs as flash-linear-attention's chunked kernel on a GPU where fla-core is
installed (``delta_rule``), else in plain torch, in chunks of 64 tokens (the recurrence in
closed form: one triangular solve a chunk): the reference the kernels are checked against.
"""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core.recurrent import over_batches
from roseinfer.layers import fused, recurrent_decode, state_conv
from roseinfer.layers.state_conv import RecurrentLayer

CHUNK = 64  # tokens the delta rule takes at once in a prompt


class HeadGatedRMSNorm(nn.Module):
    """RMSNorm over each head's ``size`` values, then times SiLU(gate) (norm before gate)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, gate, self.weight, self.eps, x.shape[-1],
                                    gate_first=False)


class GatedDeltaNet(RecurrentLayer):
    """Parameters named as transformers' Qwen3NextGatedDeltaNet: ``in_proj_qkvz`` (per key
    head: its q, k, then its value heads' v, then their z), ``in_proj_ba`` (per key head:
    its value heads' b, then their a), ``conv1d``, ``dt_bias``, ``A_log``, ``norm``,
    ``out_proj``."""
    STATE = "recurrent_state"

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int, kernel: int, eps: float):
        super().__init__()
        self.nk, self.nv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.per_key = value_heads // key_heads
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj_qkvz = nn.Linear(hidden, 2 * key_heads * key_dim +
                                      2 * value_heads * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = HeadGatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, hidden, bias=False)
        self.kernel = kernel

    def state_shape(self) -> tuple[int, ...]:
        return self.nv, self.dk, self.dv

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.shape[0]
        r, dk, dv = self.per_key, self.dk, self.dv
        q, k, v, z = self.in_proj_qkvz(h).view(tokens, self.nk, -1).split(
            [dk, dk, r * dv, r * dv], -1)
        ba = self.in_proj_ba(h).view(tokens, self.nk, 2 * r)
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], -1)
        out = over_batches(self._batch, mixed, ba)
        out = self.norm(out, z.reshape(tokens, self.nv, dv))
        return self.out_proj(out.reshape(tokens, -1))

    def _batch(self, mixed, ba, fresh, rows: torch.Tensor) -> torch.Tensor:
        """B sequences' step tokens, T each (``ba``: the gates' inputs, ``delta_gates``):
        their outputs [B, T, value heads, value dim]. A decode batch on a GPU steps its
        states in their rows, its gates in the same kernel (layers/recurrent_decode.py)."""
        mixed, conv, state = self.convolved(mixed, rows, fresh)
        n, tokens = mixed.shape[:2]
        q, k, v = mixed.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        q, k = q.view(n, tokens, self.nk, self.dk), k.view(n, tokens, self.nk, self.dk)
        v = v.view(n, tokens, self.nv, self.dv)
        if conv is None:  # a decode batch on a GPU: the states step in their rows
            out = recurrent_decode.delta_decode_in_place(
                q[:, 0], k[:, 0], v[:, 0], ba[:, 0], self.A_log, self.dt_bias,
                self.recurrent_state, rows, fresh)[:, None]
        else:
            g, beta = recurrent_decode.delta_gates(ba, self.A_log, self.dt_bias)
            out, state = delta_rule(q, k, v, g, beta, state,
                                    state_conv.kernels(mixed.device, mixed.dtype))
            self.keep(rows, conv, state)
        return out.to(mixed.dtype)


def delta_rule(q, k, v, g, beta, state: torch.Tensor, kernels: str = "torch"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over B sequences' T tokens: q, k [B, T, key heads, K] (not yet
    L2-normalised), v [B, T, value heads, V], g and beta [B, T, value heads] (float32),
    the states S [B, value heads, K, V] at their start; ``kernels`` as
    ``state_conv.kernels`` names them. Returns (outputs [B, T, value heads, V], the states
    at their end)."""
    if kernels == "fla":
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
        run = fused_recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
        return run(q, k, v.to(q.dtype), g=g, beta=beta, scale=q.shape[-1] ** -0.5,
                   initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    per_key = v.shape[2] // q.shape[2]
    q, k = (_l2norm(t.float()).repeat_interleave(per_key, 2) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    v = v.float()
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], CHUNK):
        end = min(start + CHUNK, q.shape[1])
        out[:, start:end] = _delta_chunk(q[:, start:end], k[:, start:end], v[:, start:end],
                                         g[:, start:end], beta[:, start:end], state)
    return out, state


def _delta_chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One chunk of the gated delta rule for B sequences, the per-token recurrence in
    closed form (G the running sum of ``g``, S the state at the chunk's start):

        u_t = beta_t (v_t - e^{G_t} S^T k_t - sum_{s<t} e^{G_t - G_s} (k_s . k_t) u_s)
        o_t = e^{G_t} S^T q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) u_s
        S  <- e^{G_L} S + sum_s e^{G_L - G_s} k_s u_s^T

    the u's from one unit lower-triangular solve. q, k [B, L, H, K]; v [B, L, H, V]; g,
    beta [B, L, H]; the states S [B, H, K, V] move on in place."""
    length = q.shape[1]
    cum = g.cumsum(1)                                                # [B, L, H]
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = cum[:, :, None, :] - cum[:, None, :, :]                  # [B, t, s, H]
    within = torch.where(lower[..., None], decay, float("-inf")).exp()
    strict = within * (~torch.eye(length, dtype=torch.bool, device=q.device))[..., None]
    grow = cum.exp()[..., None]                                      # [B, L, H, 1]
    a = torch.einsum("bthk,bshk->bhts", k, k) * strict.permute(0, 3, 1, 2) * \
        beta.permute(0, 2, 1)[..., None]                             # [B, H, t, s]
    rhs = beta[..., None] * (v - torch.einsum("bthk,bhkv->bthv", k, state) * grow)
    eye = torch.eye(length, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(eye + a, rhs.permute(0, 2, 1, 3), upper=False,
                                      unitriangular=True)            # [B, H, L, V]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * within.permute(0, 3, 1, 2)
    out = torch.einsum("bhts,bhsv->bthv", scores, u) + \
        torch.einsum("bthk,bhkv->bthv", q, state) * grow
    last = cum[:, -1]                                                # [B, H]
    carried = (last[:, None] - cum).exp()                            # [B, L, H]
    state.mul_(last.exp()[..., None, None]).add_(
        torch.einsum("bsh,bshk,bhsv->bhkv", carried, k, u))
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
