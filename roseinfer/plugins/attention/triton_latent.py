"""Latent attention in Triton: one KV head whose rows are the keys and the values both,
as DeepSeek's absorbed MLA keeps them (layers/mla.py): ``[k_rope | latent]``, 64 + 512
wide for DeepSeek-V3's and V2-Lite's shapes.

The generic kernels (triton_paged.py) pad a row to a power of two (576 to 1024) and load
it twice, as K and as V: at DeepSeek's width their prefill tile needs 384 KB of shared
memory, more than an SM has. Here a row is two tiles, its RoPE part (``BLOCK_R``, padded
to 16) and its latent part (``LATENT``, the largest power of two in the row), each
loaded once a key tile and used as K (scores, through its transpose) and as V (the
output). The output is the whole row's weighted sum, as attention with V = K gives; the
layer keeps the latent part.

Program ``(q_block, head_block, split)``. A program holds ``BLOCK_Q`` query tokens of one
sequence times ``BLOCK_H`` heads: all of one KV head's heads share every key tile, so
decode rows take many heads a program (the tensor cores' 16 rows at least) and prompts
several tokens of fewer heads. Decode contexts are split across programs and merged by
triton_paged's merge kernel, as the generic decode is.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch

from roseinfer.core.triton_support import kernel as _kernel, tl, triton, wait_for_inputs
from roseinfer.plugins.attention.paged_tiles import _q_block, _softmax_tile

# Measured on an H200 at V2-Lite's shape (16 heads, 64 + 512): docs/kernels.md.
LATENT_TUNING = {
    "decode": {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2,
               "programs_per_sm": 2, "max_splits": 128},
    "prefill": {"block_m": 64, "block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2},
    # float32 rows are twice the bytes: the 16-bit prompt tile overflows shared memory
    "prefill_fp32": {"block_m": 32, "block_h": 16, "block_n": 32, "num_warps": 8,
                     "num_stages": 2},
}


@_kernel
def _latent_kernel(
    q_ptr, cache_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, context_lens_ptr, query_start_ptr,
    sq_n, sq_h, so_s, so_n, so_h, sm_s, sm_n, sc_b, sc_o,
    bt_stride, table_keys, num_seqs, num_heads, rope, scale_log2, n_splits,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, LATENT: tl.constexpr,
    DECODE: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP16: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    if DECODE:  # one query token a sequence: program = sequence
        seq = tl.program_id(0)
        q_start = seq
        q_len = 1
        first_tok = 0
    else:
        seq, q_start, q_len, first_tok = _q_block(query_start_ptr, tl.program_id(0),
                                                  num_seqs, BLOCK_Q)
        if first_tok >= q_len:
            return
    context_len = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = first_tok + r // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (tok < q_len) & (head < num_heads)
    q_pos = context_len - q_len + tok          # each row sees keys at positions <= q_pos
    row = (q_start + tok).to(tl.int64)
    dr = tl.arange(0, BLOCK_R)
    dr_ok = dr < rope
    dl = tl.arange(0, LATENT)
    q_row = q_ptr + row[:, None] * sq_n + head[:, None] * sq_h
    q_r = tl.load(q_row + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    q_l = tl.load(q_row + rope + dl[None, :], mask=row_ok[:, None], other=0.0)
    if KV_FP16:  # an FP8 cache's e4m3 values widen to float16 in one instruction
        q_r, q_l = q_r.to(tl.float16), q_l.to(tl.float16)

    # Keys up to the block's last query, never past the table (a CUDA graph's padding
    # sequence); a decode row's context in equal shares of whole tiles, one a split.
    kv_hi = context_len - q_len + tl.minimum(first_tok + BLOCK_Q, q_len)
    kv_hi = tl.minimum(kv_hi, table_keys)
    share = tl.cdiv(tl.cdiv(kv_hi, BLOCK_N), n_splits) * BLOCK_N
    kv_lo = tl.program_id(2) * share
    kv_hi = tl.minimum(kv_hi, kv_lo + share)
    block_table = block_tables_ptr + seq.to(tl.int64) * bt_stride

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc_r = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    acc_l = tl.zeros([BLOCK_Q * BLOCK_H, LATENT], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        key = cache_ptr + (block * sc_b + (k_pos % BLOCK_SIZE) * sc_o)[:, None]
        k_r = tl.load(key + dr[None, :], mask=k_ok[:, None] & dr_ok[None, :], other=0.0)
        k_l = tl.load(key + rope + dl[None, :], mask=k_ok[:, None], other=0.0)
        k_r, k_l = k_r.to(q_l.dtype), k_l.to(q_l.dtype)  # an FP8 cache's values, exactly
        s = tl.dot(q_l, tl.trans(k_l), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i)
        p = p.to(k_l.dtype)
        acc_l = tl.dot(p, k_l, acc_l * alpha[:, None], input_precision=DOT_PRECISION)
        acc_r = tl.dot(p, k_r, acc_r * alpha[:, None], input_precision=DOT_PRECISION)

    # The normalised rows, or this split's unnormalised partial (acc, max, sum).
    out_row = out_ptr + tl.program_id(2).to(tl.int64) * so_s + row[:, None] * so_n + \
        head[:, None] * so_h
    if PARTIAL:
        tl.store(out_row + dr[None, :], acc_r, mask=row_ok[:, None] & dr_ok[None, :])
        tl.store(out_row + rope + dl[None, :], acc_l, mask=row_ok[:, None])
        ml = tl.program_id(2).to(tl.int64) * sm_s + row * sm_n + head
        tl.store(m_ptr + ml, m_i, mask=row_ok)
        tl.store(l_ptr + ml, l_i, mask=row_ok)
    else:
        kind = out_ptr.dtype.element_ty
        tl.store(out_row + dr[None, :], (acc_r / l_i[:, None]).to(kind),
                 mask=row_ok[:, None] & dr_ok[None, :])
        tl.store(out_row + rope + dl[None, :], (acc_l / l_i[:, None]).to(kind),
                 mask=row_ok[:, None])


def latent_width(head_dim: int) -> int:
    """The latent part of a row: the largest power of two in it (DeepSeek's 512 of 576)."""
    return 1 << (head_dim.bit_length() - 1)


def latent_attention(q, cache, attn, scale_log2: float, splits: int, pdl: bool,
                     dot_precision: str):
    """softmax(q K^T) K over the one-head ``cache`` (the values are the keys), in
    ``splits`` pieces of each decode context: the output [n, H, D], or with splits, the
    partials (accumulators [splits, n, H, D], maxima and sums [splits, n, H]) to merge."""
    n, num_heads, head_dim = q.shape
    if cache.shape[1] != 1 or cache.stride(-1) != 1:
        raise ValueError("latent attention reads one KV head with contiguous rows")
    if q.stride(-1) != 1:
        q = q.contiguous()
    latent = latent_width(head_dim)
    rope = head_dim - latent
    tune = LATENT_TUNING["decode" if attn.is_decode else
                         "prefill" if q.element_size() <= 2 else "prefill_fp32"]
    block_h = head_block(num_heads, tune)
    block_q = 1 if attn.is_decode else max(1, tune["block_m"] // block_h)
    if splits == 1:
        out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
        dest, m, l = out.unsqueeze(0), out, out  # m, l unused without splits
    else:
        dest = torch.empty(splits, n, num_heads, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(splits, n, num_heads, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    programs = attn.num_seqs if attn.is_decode else n // block_q + attn.num_seqs
    _latent_kernel[(programs, triton.cdiv(num_heads, block_h), splits)](
        q, cache, dest, m, l, attn.block_tables, attn.context_lens, attn.query_start,
        q.stride(0), q.stride(1), *dest.stride()[:3], *m.stride()[:2],
        cache.stride(0), cache.stride(2), attn.block_tables.stride(0),
        attn.block_tables.shape[1] * cache.shape[2], attn.num_seqs, num_heads, rope,
        scale_log2, splits, BLOCK_SIZE=cache.shape[2], BLOCK_Q=block_q, BLOCK_H=block_h,
        BLOCK_N=tune["block_n"], BLOCK_R=max(16, triton.next_power_of_2(rope)), LATENT=latent,
        DECODE=attn.is_decode, PARTIAL=splits > 1, DOT_PRECISION=dot_precision,
        KV_FP16=cache.dtype == torch.float8_e4m3fn and q.element_size() == 2, PDL=pdl,
        launch_pdl=pdl, num_warps=tune["num_warps"], num_stages=tune["num_stages"])
    return out if splits == 1 else (dest, m, l)


def head_block(num_heads: int, tune: dict) -> int:
    """Heads a program holds: the tuning's, or all of them where fewer (padded to the
    tensor cores' 16 rows)."""
    return min(tune["block_h"], max(16, triton.next_power_of_2(num_heads)))
