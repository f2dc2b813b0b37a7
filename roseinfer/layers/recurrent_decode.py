"""One decode step of a recurrent layer for a batch of sequences, each updating its state
in place in its row of the layer's state tensor: gated DeltaNet's delta rule
(layers/gated_deltanet.py) and Mamba2's SSM (layers/mamba2.py).

A state is 2 MiB a sequence a layer at Qwen3-Next's shape, 4 MiB at Granite 4.0-H's.
Gathering the step's rows into a batch, running the recurrence on the copy and writing it
back moved every state three times over, and cost four launches a layer; here one program
a (sequence, head, block of 32 columns) reads its tile of the state from the row, steps
it, writes it back and stores its outputs. A sequence whose token is its first
(``fresh``) starts from zeros. The layers' depthwise convolution before it steps its
inputs in their rows the same way (``conv_decode_in_place``, with the SiLU after it): a
launch where gathering, shifting, convolving, activating and writing back took about
eight. Triton on CUDA (and interpreted, for tests); each ``*_torch`` is the same step in
plain torch.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import kernel as _kernel, tl, triton

EPS = 1e-6     # the q/k L2 norm's, as the torch form's (gated_deltanet._l2norm)
BLOCK_V = 32   # value columns a program: a [key dim, 32] float32 tile of the state
BLOCK_P = 32   # Mamba2: head-dim rows a program, a [32, state size] float32 tile
BLOCK_C = 128  # the convolution's channels a program


def steps_in_place(x: torch.Tensor) -> bool:
    """Whether a decode batch's states step in their rows (Triton: on a GPU)."""
    return x.is_cuda


def delta_gates(ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's (g, beta), float32 [..., value heads], from ``in_proj_ba``'s output
    [..., key heads, 2 x value heads a key head] (per key head: its value heads' b, then
    their a): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    b, a = ba.float().split(ba.shape[-1] // 2, -1)
    g = -a_log.float().exp() * F.softplus(a.flatten(-2) + dt_bias.float())
    return g, b.flatten(-2).sigmoid()


@_kernel
def _delta_decode_kernel(q_ptr, k_ptr, v_ptr, ba_ptr, a_log_ptr, dt_bias_ptr, state_ptr,
                         rows_ptr, fresh_ptr, out_ptr, scale, per_key, s_qb, s_qh, s_vb, s_vh,
                         s_bab, s_bah, s_row, s_head, s_ob, s_oh,
                         K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, EPS: tl.constexpr):
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < K, vv < V
    key_head = h // per_key
    q = tl.load(q_ptr + b * s_qb + key_head * s_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * s_qb + key_head * s_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + EPS) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + EPS)
    # the gates (delta_gates): this head's b and a in its key head's row of in_proj_ba
    gates = ba_ptr + b * s_bab + key_head * s_bah + h % per_key
    beta = tl.sigmoid(tl.load(gates).to(tl.float32))
    a = tl.load(gates + per_key).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    row = tl.load(rows_ptr + b).to(tl.int64)
    tile = state_ptr + row * s_row + h * s_head + kk[:, None] * V + vv[None, :]
    ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(tile, mask=ok, other=0.0)
    s = tl.where(tl.load(fresh_ptr + b) != 0, 0.0, s)
    s = s * tl.exp(g)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + vv, mask=v_ok, other=0.0).to(tl.float32)
    u = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    tl.store(tile, s, mask=ok)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + b * s_ob + h * s_oh + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)


def delta_decode_in_place(q, k, v, ba, a_log, dt_bias, state: torch.Tensor,
                          rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """q, k [B, key heads, K] (not yet L2-normalised, the same strides), v [B, value heads,
    V], ``ba`` [B, key heads, 2 x value heads a key head] (the gates' inputs, with
    ``a_log`` and ``dt_bias`` [value heads]: ``delta_gates``); ``state`` [rows, value
    heads, K, V] float32, the batch's in ``rows`` [B], those where ``fresh`` [B] from zeros.
    Returns the outputs [B, value heads, V] in v's dtype; the rows hold the states after
    the step."""
    batch, heads, dv = v.shape
    dk = q.shape[-1]
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    v, ba = (t if t.stride(-1) == 1 else t.contiguous() for t in (v, ba))
    assert state.is_contiguous() and state.shape[1:] == (heads, dk, dv)
    out = torch.empty(batch, heads, dv, dtype=v.dtype, device=v.device)
    _delta_decode_kernel[(batch, heads, triton.cdiv(dv, BLOCK_V))](
        q, k, v, ba, a_log, dt_bias, state, rows, fresh, out, dk ** -0.5, heads // q.shape[1],
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), ba.stride(0), ba.stride(1),
        state.stride(0), state.stride(1), out.stride(0), out.stride(1),
        K=dk, V=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, EPS=EPS)
    return out


def delta_decode_torch(q, k, v, ba, a_log, dt_bias, state: torch.Tensor, rows: torch.Tensor,
                       fresh: torch.Tensor) -> torch.Tensor:
    """``delta_decode_in_place`` in plain torch: the reference its tests hold it to."""
    g, beta = delta_gates(ba, a_log, dt_bias)
    per_key = v.shape[1] // q.shape[1]
    q, k = (t.float().repeat_interleave(per_key, 1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + EPS)
    s = state[rows].masked_fill(fresh.view(-1, 1, 1, 1), 0) * g.exp()[..., None, None]
    u = beta[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., None] * u[..., None, :]
    state[rows] = s
    return torch.einsum("bhkv,bhk->bhv", s, q).to(v.dtype)


@_kernel
def _ssm_decode_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, rows_ptr, fresh_ptr,
                       out_ptr, s_xb, s_xh, s_db, s_bb, s_bh, s_row, s_head,
                       P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    b, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    p_ok, n_ok = pp < P, nn < N
    row = tl.load(rows_ptr + b).to(tl.int64)
    tile = state_ptr + row * s_row + h * s_head + pp[:, None] * N + nn[None, :]
    ok = p_ok[:, None] & n_ok[None, :]
    s = tl.load(tile, mask=ok, other=0.0)
    s = tl.where(tl.load(fresh_ptr + b) != 0, 0.0, s)
    x = tl.load(x_ptr + b * s_xb + h * s_xh + pp, mask=p_ok, other=0.0)
    dt = tl.load(dt_ptr + b * s_db + h)
    key = tl.load(b_ptr + b * s_bb + h * s_bh + nn, mask=n_ok, other=0.0)
    query = tl.load(c_ptr + b * s_bb + h * s_bh + nn, mask=n_ok, other=0.0)
    s = s * tl.exp(tl.load(a_ptr + b * s_db + h)) + (dt * x)[:, None] * key[None, :]
    tl.store(tile, s, mask=ok)
    tl.store(out_ptr + b * s_xb + h * s_xh + pp, tl.sum(s * query[None, :], axis=1), mask=p_ok)


def ssm_decode_in_place(x, dt, a, b, c, state: torch.Tensor, rows: torch.Tensor,
                        fresh: torch.Tensor) -> torch.Tensor:
    """Mamba2's SSM for one token a sequence: x [B, H, P], dt and a [B, H], b and c [B, H,
    N] (float32); ``state`` [rows, H, P, N] float32, the batch's in ``rows`` [B], those
    where ``fresh`` [B] from zeros. Returns y [B, H, P] (without D's skip); the rows hold
    the states after the step."""
    batch, heads, p = x.shape
    n = b.shape[-1]
    x, dt, a, b, c = (t.float().contiguous() for t in (x, dt, a, b, c))
    assert state.is_contiguous() and state.shape[1:] == (heads, p, n)
    out = torch.empty_like(x)
    _ssm_decode_kernel[(batch, heads, triton.cdiv(p, BLOCK_P))](
        x, dt, a, b, c, state, rows, fresh, out, x.stride(0), x.stride(1), dt.stride(0),
        b.stride(0), b.stride(1), state.stride(0), state.stride(1),
        P=p, N=n, BLOCK_P=BLOCK_P, BLOCK_N=triton.next_power_of_2(n))
    return out


def ssm_decode_torch(x, dt, a, b, c, state: torch.Tensor, rows: torch.Tensor,
                     fresh: torch.Tensor) -> torch.Tensor:
    """``ssm_decode_in_place`` in plain torch."""
    s = state[rows].masked_fill(fresh.view(-1, 1, 1, 1), 0) * a.exp()[..., None, None]
    s = s + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    state[rows] = s
    return torch.einsum("bhpn,bhn->bhp", s, c)


@_kernel
def _conv_decode_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, rows_ptr, fresh_ptr, out_ptr, C,
                        s_xb, s_row, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    b, cb = tl.program_id(0), tl.program_id(1)
    cc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cc < C
    fresh = tl.load(fresh_ptr + b) != 0
    window = state_ptr + tl.load(rows_ptr + b).to(tl.int64) * s_row + cc * (K - 1)
    x = tl.load(x_ptr + b * s_xb + cc, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + cc * K + K - 1, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cc, mask=ok, other=0.0).to(tl.float32)
    # each input moves one place back; a thread stores only what it loaded the pass before
    for j in tl.static_range(K - 1):
        v = tl.load(window + j, mask=ok, other=0.0)
        v = tl.where(fresh, tl.zeros_like(v), v)
        acc += v.to(tl.float32) * tl.load(w_ptr + cc * K + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(window + j - 1, v, mask=ok)
    tl.store(window + K - 2, x.to(state_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + b * C + cc, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ok)


def conv_decode_in_place(x: torch.Tensor, state: torch.Tensor, conv: nn.Conv1d,
                         rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The recurrent layers' depthwise causal convolution and SiLU for one token a
    sequence: x [B, C]; ``state`` [rows, C, kernel - 1], each row its sequence's inputs
    before the token, the batch's in ``rows`` [B] (those where ``fresh`` [B] from zeros),
    moved on by x in place. Returns SiLU(conv) [B, C] in x's dtype."""
    batch, channels = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert state.is_contiguous() and state.shape[1] == channels
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    bias = conv.bias
    _conv_decode_kernel[(batch, triton.cdiv(channels, BLOCK_C))](
        x, state, conv.weight, conv.weight if bias is None else bias, rows, fresh, out,
        channels, x.stride(0), state.stride(0), HAS_BIAS=bias is not None,
        K=conv.weight.shape[-1], BLOCK_C=BLOCK_C)
    return out


def conv_decode_torch(x: torch.Tensor, state: torch.Tensor, conv: nn.Conv1d,
                      rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``conv_decode_in_place`` in plain torch."""
    window = torch.cat([state[rows].masked_fill(fresh.view(-1, 1, 1), 0),
                        x[:, :, None].to(state.dtype)], dim=2)
    state[rows] = window[..., 1:]
    out = F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=x.shape[1])
    return F.silu(out[..., 0]).to(x.dtype)
