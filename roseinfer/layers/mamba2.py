"""Mamba2's mixer (the SSD layer), each sequence carrying its state from step to step.

A sequence keeps, per mixer, the last ``kernel - 1`` inputs of its causal convolution and
its SSM state (heads x head dim x state size, float32), in the rows of the recurrent-state
cache (core/recurrent.py) that its block-table row names. A sequence whose step starts at
position 0 starts from zeros, so a preempted and recomputed one, or a new one on a freed
row, never reads another's state.

A prompt's chunk at a time, and every decoding sequence of a step in one batch
(core/recurrent.py, ``batches``): the convolution over the stored inputs and the step's,
then the SSM over the step's tokens (``ssm``). The SSM is simple gated linear attention
(C the queries, B the keys, dt x the values, dt A each token's log decay per head), so on
a GPU where fla-core imports a prompt's chunk runs as flash-linear-attention's simple-GLA
kernels; elsewhere in plain torch in chunks (the SSD form: within a chunk a masked
product, across chunks the state carried), the reference the kernels are checked against.
A decode batch on a GPU steps each state in its row (layers/recurrent_decode.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.recurrent import over_batches
from roseinfer.layers import fused, recurrent_decode, state_conv
from roseinfer.layers.state_conv import RecurrentLayer

CHUNK = 64  # tokens the SSM takes at once in a prompt


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``x * silu(gate)`` over groups of ``group`` channels (Mamba2's)."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, gate, self.weight, self.eps, self.group,
                                    gate_first=True)


class Mamba2Mixer(RecurrentLayer):
    """in_proj -> causal conv1d + SiLU over (x, B, C) -> SSM with per-head dt, A, D ->
    gated RMSNorm -> out_proj; parameters named as transformers names them."""
    STATE = "ssm_state"

    def __init__(self, hidden: int, inner: int, heads: int, head_dim: int, state: int,
                 groups: int, kernel: int, eps: float, bias: bool = False,
                 conv_bias: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf"))):
        super().__init__()
        self.inner = inner
        self.heads, self.head_dim, self.state, self.groups = heads, head_dim, state, groups
        self.conv_dim = self.inner + 2 * groups * state
        self.kernel, self.dt_limit = kernel, dt_limit
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + heads, bias=bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // groups, eps)
        self.out_proj = nn.Linear(self.inner, hidden, bias=bias)

    def state_shape(self) -> tuple[int, ...]:
        return self.heads, self.head_dim, self.state

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], -1)
        y = over_batches(self._batch, xbc, dt)
        return self.out_proj(self.norm(y, gate))

    def _batch(self, xbc: torch.Tensor, dt: torch.Tensor, fresh: bool | torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """B sequences' step tokens, T each (their states in ``rows``): the SSM's output
        [B, T, inner]."""
        xbc, conv, ssm = self.convolved(xbc, rows, fresh)
        x, b, c = xbc.split([self.inner, self.groups * self.state,
                             self.groups * self.state], -1)
        per_group = self.heads // self.groups
        n, tokens = x.shape[:2]
        b, c = (t.float().view(n, tokens, self.groups, self.state)
                .repeat_interleave(per_group, 2) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [B, T, H]
        x = x.float().view(n, tokens, self.heads, self.head_dim)
        a = -torch.exp(self.A_log.float()) * dt  # log of each token's decay, [B, T, H]
        if conv is None:  # a decode batch on a GPU: the states step in their rows
            out = recurrent_decode.ssm_decode_in_place(
                x[:, 0], dt[:, 0], a[:, 0], b[:, 0], c[:, 0], self.ssm_state, rows,
                fresh)[:, None]
        else:
            out, ssm = ssm_scan(x, dt, a, b, c, ssm, state_conv.kernels(xbc.device, xbc.dtype))
            self.keep(rows, conv, ssm)
        out = out + self.D.float()[:, None] * x
        return out.view(n, tokens, self.inner).to(xbc.dtype)


def ssm_scan(x, dt, a, b, c, state: torch.Tensor, kernels: str = "torch"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over B sequences' T tokens: x [B, T, H, P], dt and a [B, T, H], b and c
    [B, T, H, N] (float32), the states S [B, H, P, N] at their start; ``kernels`` as
    ``state_conv.kernels`` names them. Returns (y [B, T, H, P], without D's skip; the states
    at their end)."""
    if kernels == "fla":
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
        run = fused_recurrent_simple_gla if x.shape[1] == 1 else chunk_simple_gla
        return run(c, b, x * dt[..., None], g=a, scale=1.0, initial_state=state,
                   output_final_state=True, state_v_first=True)
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], CHUNK):
        end = min(start + CHUNK, x.shape[1])
        out[:, start:end] = _ssd_chunk(x[:, start:end], dt[:, start:end], a[:, start:end],
                                       b[:, start:end], c[:, start:end], state)
    return out, state


def _ssd_chunk(x, dt, a, b, c, state: torch.Tensor) -> torch.Tensor:
    """One chunk of the SSM for B sequences: y_t = sum_{u<=t} exp(A_t - A_u) (C_t . B_u)
    dt_u x_u + exp(A_t) C_t . S, A the running sum of ``a``; the states S [B, H, P, N] move
    on in place. x [B, T, H, P]; dt, a [B, T, H]; b, c [B, T, H, N]."""
    cum = a.cumsum(1)                                               # [B, T, H]
    decay = cum[:, :, None, :] - cum[:, None, :, :]                 # [B, t, u, H]
    causal = torch.ones(decay.shape[1:3], dtype=torch.bool, device=x.device).tril()
    weights = torch.where(causal[..., None], decay, float("-inf")).exp()
    scores = torch.einsum("bthn,buhn->btuh", c, b) * weights * dt[:, None]
    y = torch.einsum("btuh,buhp->bthp", scores, x)
    y += torch.einsum("bthn,bhpn->bthp", c, state) * cum.exp()[..., None]
    last = cum[:, -1]                                               # [B, H]
    carried = (last[:, None] - cum).exp() * dt                      # [B, T, H]
    state.mul_(last.exp()[..., None, None]).add_(
        torch.einsum("bth,bthp,bthn->bhpn", carried, x, b))
    return y
