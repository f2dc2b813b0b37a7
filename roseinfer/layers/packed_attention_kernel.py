"""Attention over packed sequences with a grid that depends only on the token count:
each program takes BLOCK_M rows (tokens, of one sequence or of several) and one head,
and reads the keys between its first row's sequence start and its last row's sequence
end, masking each row to its own sequence (``bounds``: each row's [start, end)).

torch's flash ``varlen_attn`` sizes its grid by the number of sequences and the longest,
so a CUDA graph captured for one batch cannot replay another; this kernel's can, which is
what the pooling runner's graphs (core/pooling_graphs.py) need. A row whose bounds are
empty (a graph's padding) gets zeros. A block that spans two sequences reads both
sequences' keys: at most about twice a block's share.
"""
from __future__ import annotations

import torch

from roseinfer.core.triton_support import kernel, tl, triton

BLOCK_M = BLOCK_N = 64


@kernel
def _packed_attention_kernel(Q, K, V, O, LO, HI, n_rows, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
                             so_n, so_h, scale, window, GROUP: tl.constexpr,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                             WINDOWED: tl.constexpr, PRECISION: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    lo = tl.load(LO + rows, mask=row_ok, other=2 ** 30)
    hi = tl.load(HI + rows, mask=row_ok, other=0)
    start, end = tl.min(lo, 0), tl.max(hi, 0)
    last_row = tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, n_rows) - 1
    if CAUSAL:
        end = tl.minimum(end, last_row + 1)
    if WINDOWED:
        start = tl.maximum(start, tl.program_id(0) * BLOCK_M - window)
        end = tl.minimum(end, last_row + window + 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + rows[:, None] * sq_n + head * sq_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k = tl.load(K + keys[:, None] * sk_n + kv_head * sk_h + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + keys[:, None] * sv_n + kv_head * sv_h + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
        if CAUSAL:
            seen = seen & (keys[None, :] <= rows[:, None])
        if WINDOWED:
            offset = rows[:, None] - keys[None, :]
            seen = seen & (offset <= window) & (offset >= -window)
        s = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + rows[:, None] * so_n + head * so_h + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def packed_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            bounds: torch.Tensor, causal: bool = False,
                            scale: float | None = None, window: int | None = None
                            ) -> torch.Tensor:
    """q [N, H, D], k and v [N, H_kv, D] (last dim contiguous); ``bounds`` [2, N] int32:
    each row's sequence's first row and the row after its last. [N, H, D]."""
    n, heads, dim = q.shape
    out = torch.empty(n, heads, dim, device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(n, BLOCK_M), heads)
    _packed_attention_kernel[grid](
        q, k, v, out, bounds[0], bounds[1], n, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        dim ** -0.5 if scale is None else scale, window or 0, GROUP=heads // k.shape[1],
        D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, CAUSAL=causal, WINDOWED=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # float32 stays exact
    return out


def sequence_bounds(lens: list[int], rows: int) -> torch.Tensor:
    """[2, rows] int32 on the host: each packed row's sequence's [start, end); rows past
    the sequences (padding) get empty bounds at their own row."""
    lens_t = torch.tensor(lens)
    ends = lens_t.cumsum(0)
    lo = torch.arange(rows, dtype=torch.int64)
    hi = lo.clone()
    used = int(ends[-1]) if lens else 0
    lo[:used] = torch.repeat_interleave(ends - lens_t, lens_t)
    hi[:used] = torch.repeat_interleave(ends, lens_t)
    return torch.stack([lo, hi]).to(torch.int32)
