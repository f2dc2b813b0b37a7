"""Triton pieces the paged attention kernels share (triton_paged.py, triton_latent.py)."""
from __future__ import annotations  # kernel annotations stay strings without triton

from roseinfer.core.triton_support import kernel as _kernel, tl


@_kernel
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q-blocks contain ``q_block``: binary search over starts."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@_kernel
def _q_block(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, its first query row, its query count, the q-block's first token in it)
    of q-block ``q_block``; a first token past the count marks a surplus program."""
    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    return seq, q_start, q_len, (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q


@_kernel
def _softmax_tile(s, m_i, l_i, ROWS_MAY_BE_EMPTY: tl.constexpr = False):
    """Online softmax over one more tile of base-2 scores ``s`` [rows, keys]:
    returns (weights p, rescale factor alpha for the accumulator, new running
    max, new running sum); the caller does ``acc * alpha + p @ V``.
    ``ROWS_MAY_BE_EMPTY``: a row may have seen no key yet (a window's rows start at
    different keys): its max stays -inf, and its weights 0, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROWS_MAY_BE_EMPTY:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

