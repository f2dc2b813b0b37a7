"""Paged attention in Triton: prefill chunks and decode rows of one step in one launch.

Grid ``(q_block, kv_head, split)``. A q-block is up to ``BLOCK_Q`` query tokens
of one sequence times the ``G = H / H_kv`` query heads that share a KV head,
flattened into ``BLOCK_M = BLOCK_Q * G`` rows, so each K/V tile is loaded once
for the whole group. Sequences own ``ceil(q_len / BLOCK_Q)`` q-blocks each,
packed without padding: sequence ``s`` starts at q-block
``query_start[s] // BLOCK_Q + s`` (a program finds its sequence by binary
search), so ``N // BLOCK_Q + S`` programs cover any batch and the few surplus
ones exit at once.

Decode batches (one query row per sequence) take a kernel of their own:
program ``(seq, kv_head, split)``, no search, no tensor cores (see
``_paged_decode_kernel``). They give only ``S * H_kv`` programs, too few for
a GPU when contexts are long, so the context is split across programs
(flash-decoding):
each split writes an unnormalised partial (running max, sum, accumulator) and
a second kernel merges them. Shapes depend only on ``N``, ``S`` and
``attn.max_context_len``: capture CUDA graphs with ``max_context_len`` set to
the context bound.

An FP8 cache (``kv_cache_dtype="fp8"``) is read as e4m3 and widened in registers (a
16-bit query's products then run in float16), so half a bfloat16 cache's bytes cross
memory.

A sliding-window layer (``window``) reads only keys its queries see, p - window + 1 .. p:
a decode row splits its window, not its context, over programs. Attention sinks
(``sinks``, gpt-oss's logit per head) start each row's running softmax as a key with no
value would: max = the sink, sum = 1 (in a split decode, the first split's). A soft cap
(``softcap``, Gemma 2's) bounds each score as cap * tanh(score / cap), in base-2 units.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import functools
import math

import torch

from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    triton_usable, wait_for_inputs
from roseinfer.plugins.attention.paged_tiles import _q_block, _softmax_tile
from roseinfer.plugins.attention.triton_latent import LATENT_TUNING, head_block, latent_attention

# Launch settings: prefill, and decode per (head dim, query heads per KV
# head), measured on an H100 and an H200 (docs/kernels.md); "decode" is the setting for
# shapes not in the table. Dicts, so benchmarks can sweep them.
# programs_per_sm: decode contexts are split until the grid has this many per SM, in at
# most max_splits (default MAX_SPLITS) pieces a sequence.
TUNING = {"decode": {"block_n": 16, "num_warps": 1, "num_stages": 2, "dot": False,
                     "programs_per_sm": 8},
          "prefill": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}
_TC = {"block_n": 64, "num_warps": 4, "num_stages": 2, "dot": True, "programs_per_sm": 4}
DECODE_TUNING: dict[tuple[int, int], dict] = {
    (64, 4): _TC, (64, 8): _TC, (128, 4): _TC, (128, 8): dict(_TC, num_stages=3),
    (128, 6): _TC,  # Qwen2.5-1.5B: 1.2-1.3x its decode (docs/kernels.md)
    # Gemma 2 and 3: a 256-wide tile holds an SM's shared memory twice as long, so half the
    # programs; 32 splits of a 32k context at 89 % of the copy rate, 64 at 76 % (H200)
    (256, 2): dict(_TC, num_stages=3, programs_per_sm=2, max_splits=32),
    # Qwen3-Next (16 heads over 2 KV heads of 256): 1-13 % of the copy rate on the default
    # setting, 54 % at 1 x 32k, 82 % at 1 x 128k and 86-88 % from 4 x 32k to 256 x 1k here
    # (H200, docs/kernels.md "Long contexts")
    (256, 8): dict(_TC, programs_per_sm=2, max_splits=128),
}
# Over an FP8 cache a tensor-core tile takes 128 keys, half a 16-bit tile's bytes a key:
# the fastest of 32, 64 and 128 on the H100 at (64, 4) and (128, 4), 1.2-1.4x the 64-key
# tile at batch 64-256 (docs/kernels.md); two stages and four programs an SM, at head
# dims 128 and 256 alike, the best of the H200's sweep (docs/kernels.md "Long contexts").
FP8_TILE = {"block_n": 128, "num_stages": 2, "programs_per_sm": 4}
# Steps of at least LONG_PREFILL tokens (a long prompt's chunks) take larger prefill tiles by
# head dim, where an SM's shared memory holds them (LONG_PREFILL_SMEM bytes; H100, H200): on
# an H200, 8k-32k-token prompts' attention ran 1.10-1.15x the 64 x 32 tile's speed at head
# dim 128 and 1.27-1.31x at 256, and short prompts' steps lose to 1.3x of a far smaller time
# (docs/kernels.md "Prefill tiles").
LONG_PREFILL = 2048
LONG_PREFILL_SMEM = 192 << 10
PREFILL_LONG_TUNING = {128: {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
                       256: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}}
MIN_SPLIT_LEN = 64     # context bound per split below which splitting only adds merging
NO_WINDOW = 2 ** 30    # the decode kernel's window where a layer has none: past any context
# One long sequence has only H_kv programs of its own: 64 splits of a Llama-3-8B 32k
# context read K/V at 83 % of the copy rate, 16 at 49 % (H200, docs/kernels.md "Long
# contexts").
MAX_SPLITS = 64
MERGE_DIMS = 256       # a merge program's dims: every head dim the tuning table names


@_kernel
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, start, kv_hi, kv_head, d, d_ok,
                  sc_b, sc_h, sc_o, sc_d, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_T: tl.constexpr, MASK_KEYS: tl.constexpr = True):
    """K and V of keys [start, start + BLOCK_N) of one KV head, through the block
    table; keys at or past ``kv_hi`` are masked (zeros), unless ``MASK_KEYS`` is off (the
    caller knows the tile lies below ``kv_hi``). Returns (positions, ok, k, v):
    k as [keys, dims], or with ``K_T`` loaded as [dims, keys], the operand of q @ k.T as
    it is. An 8-bit K tile transposed in registers went through shared memory element by
    element (no transposing ldmatrix for 8 bits), which loading it transposed avoids."""
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_hi
    key_mask = k_ok if MASK_KEYS else k_pos >= 0
    # int64: block index * block stride overflows int32 on large caches.
    if MASK_KEYS:
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        block = tl.load(block_table + k_pos // BLOCK_SIZE).to(tl.int64)
    base = block * sc_b + kv_head * sc_h + (k_pos % BLOCK_SIZE) * sc_o
    kv_off = base[:, None] + d[None, :] * sc_d
    kv_mask = key_mask[:, None] & d_ok[None, :]
    if K_T:
        k = tl.load(k_cache_ptr + base[None, :] + d[:, None] * sc_d,
                    mask=d_ok[:, None] & key_mask[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    return k_pos, k_ok, k, v


@_kernel
def _scores(q, k, DOT_PRECISION: tl.constexpr, K_T: tl.constexpr):
    """q @ k.T on the tensor cores, k as ``_load_kv_tile`` returned it."""
    if K_T:
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return s


@_kernel
def _capped(s, softcap_log2, SOFTCAP: tl.constexpr):
    """Base-2 scores ``s`` soft-capped: c * tanh(s / c), with c the cap in base-2 units
    (tanh through exp, which the interpreter and every GPU have)."""
    if SOFTCAP:
        s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))
    return s


@_kernel
def _softmax_start(sinks_ptr, head, ok, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(running max, running sum) of rows before any key: -inf and 0, or with sinks the
    head's sink logit (base 2) and 1, as if a key with that score and no value came
    first."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i


@_kernel
def _seen(k_pos, k_ok, q_pos, last, window, HAS_WINDOW: tl.constexpr):
    """[rows, keys]: which keys each query row sees: up to ``last`` (its own position, or
    past it for an image's tokens attending both ways); within its window."""
    seen = k_ok[None, :] & (k_pos[None, :] <= last[:, None])
    if HAS_WINDOW:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


@_kernel
def _prefill_tiles(q, m_i, l_i, acc, lo, hi, kv_hi, q_pos, last, window, k_cache_ptr,
                   v_cache_ptr,
                   block_table, kv_head, d, d_ok, sc_b, sc_h, sc_o, sc_d, scale_log2,
                   softcap_log2, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, KV_FP16: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Keys [lo, hi) into a q-block's running softmax, tile by tile; ``MASKED`` off where
    every row sees every key of the range (no causal mask, no bound on the loads)."""
    for start in range(lo, hi, BLOCK_N):
        k_pos, k_ok, k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, start, kv_hi, kv_head, d, d_ok,
            sc_b, sc_h, sc_o, sc_d, BLOCK_SIZE, BLOCK_N, KV_FP16, MASKED)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 cache's e4m3 values, exactly
        s = _capped(_scores(q, k, DOT_PRECISION, KV_FP16) * scale_log2, softcap_log2, SOFTCAP)
        if MASKED:
            s = tl.where(_seen(k_pos, k_ok, q_pos, last, window, HAS_WINDOW), s,
                         float("-inf"))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, HAS_WINDOW)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@_kernel
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, query_start_ptr,
    sq_n, sq_h, sq_d,                 # q strides (a view of fused qkv is fine)
    so_n, so_h,                       # out strides (d stride 1)
    sc_b, sc_h, sc_o, sc_d,           # cache strides, K and V alike
    bt_stride, table_keys, num_seqs, head_dim, scale_log2, window, sinks_ptr, softcap_log2,
    visible_ptr,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP16: tl.constexpr, PDL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_VISIBLE: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    kv_head = tl.program_id(1)
    seq, q_start, q_len, first_tok = _q_block(query_start_ptr, tl.program_id(0), num_seqs,
                                              BLOCK_Q)
    if first_tok >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // G
    head = kv_head * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < q_len)
    q_pos = context_len - q_len + tok          # each row sees keys at positions <= q_pos
    row = (q_start + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + row[:, None] * sq_n + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_FP16:
        q = q.to(tl.float16)

    # Keys up to the block's last query. Every row sees the first key, so the
    # running max is finite after the first tile (no -inf - -inf).
    kv_hi = context_len - q_len + tl.minimum(first_tok + BLOCK_Q, q_len)
    last = q_pos
    if HAS_VISIBLE:  # an image's tokens attending both ways see on to its last
        last = tl.maximum(q_pos, tl.load(visible_ptr + q_start + tok, mask=row_ok, other=-1))
        kv_hi = tl.maximum(kv_hi, tl.max(tl.where(row_ok, last, 0)) + 1)
    # A CUDA graph's padding sequence may hold more tokens than a block table
    # covers (step_inputs._pad): it reads no keys past the table.
    kv_hi = tl.minimum(kv_hi, table_keys)
    block_table = block_tables_ptr + seq.to(tl.int64) * bt_stride

    # With a window, from the first key the block's first query sees.
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(context_len - q_len + first_tok - window + 1, 0)

    # Keys every row sees (up to the first query's own position; no window) take tiles
    # without the causal mask; the tiles from there to kv_hi, the diagonal, with it.
    full_hi = kv_lo
    if not HAS_WINDOW:
        seen_by_all = tl.minimum(context_len - q_len + first_tok + 1, kv_hi)
        full_hi = kv_lo + (seen_by_all - kv_lo) // BLOCK_N * BLOCK_N
    m_i, l_i = _softmax_start(sinks_ptr, head, row_ok, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _prefill_tiles(
        q, m_i, l_i, acc, kv_lo, full_hi, kv_hi, q_pos, last, window, k_cache_ptr, v_cache_ptr,
        block_table, kv_head, d, d_ok, sc_b, sc_h, sc_o, sc_d, scale_log2, softcap_log2,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, KV_FP16, HAS_WINDOW, SOFTCAP, False)
    m_i, l_i, acc = _prefill_tiles(
        q, m_i, l_i, acc, full_hi, kv_hi, kv_hi, q_pos, last, window, k_cache_ptr, v_cache_ptr,
        block_table, kv_head, d, d_ok, sc_b, sc_h, sc_o, sc_d, scale_log2, softcap_log2,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, KV_FP16, HAS_WINDOW, SOFTCAP, True)
    out = acc / l_i[:, None]
    tl.store(out_ptr + row[:, None] * so_n + head[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@_kernel
def _decode_tile(q, k, v, k_ok, m_i, l_i, acc, scale_log2, softcap_log2,
                 DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, K_T: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One K/V tile into a decode group's running softmax (max, sum, accumulator).

    Two ways, picked per shape by measurement (DECODE_TUNING): broadcast
    products reduced on CUDA cores (``DOT`` off: no tile staged in shared
    memory, so many small programs fit on an SM at once, which hides the
    latency of the dependent loads, table then K/V), or tensor-core dots with
    the group padded to 16 rows (``DOT`` on: K/V tiles go through shared
    memory in a multi-stage pipeline, more bytes in flight per program).
    """
    if DOT:
        s = _scores(q, k, DOT_PRECISION, K_T) * scale_log2
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale_log2  # [G, N]
    s = tl.where(k_ok[None, :], _capped(s, softcap_log2, SOFTCAP), float("-inf"))
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i)
    if DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    return m_i, l_i, acc * alpha[:, None] + pv


@_kernel
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, context_lens_ptr,
    sq_n, sq_h, sq_d, so_s, so_n, so_h, sm_s, sm_n, sc_b, sc_h, sc_o, sc_d,
    bt_stride, head_dim, scale_log2, n_splits, window, sinks_ptr, softcap_log2,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr, DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP16: tl.constexpr, PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Decode rows only: program (seq, kv_head, split) owns query row ``seq``
    and the ``G`` query heads of ``kv_head`` (tiles: ``_decode_tile``)."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    head = kv_head * G + g
    g_ok = g < G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    row = tl.zeros([BLOCK_G], tl.int64) + seq
    q = tl.load(q_ptr + row[:, None] * sq_n + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_FP16:
        q = q.to(tl.float16)
    if not DOT:
        q = q.to(tl.float32)

    # Each split takes an equal share of this sequence's own context (whole
    # tiles), so a graph captured for the context bound splits short contexts too;
    # of a window layer's, only the window.
    first = tl.maximum(context_len - window, 0)
    share = tl.cdiv(tl.cdiv(context_len - first, BLOCK_N), n_splits) * BLOCK_N
    kv_lo = first + split * share
    kv_hi = tl.minimum(context_len, kv_lo + share)
    block_table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m_i, l_i = _softmax_start(sinks_ptr, head, g_ok, BLOCK_G, HAS_SINKS)
    if HAS_SINKS and split > 0:  # the sink counts once, in the first split
        m_i, l_i = tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        _, k_ok, k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, start, kv_hi, kv_head, d, d_ok,
            sc_b, sc_h, sc_o, sc_d, BLOCK_SIZE, BLOCK_N, KV_FP16 and DOT)
        m_i, l_i, acc = _decode_tile(q, k.to(q.dtype), v.to(q.dtype), k_ok, m_i, l_i, acc,
                                     scale_log2, softcap_log2, DOT, DOT_PRECISION,
                                     KV_FP16 and DOT, SOFTCAP)
    # The normalised output, or this split's unnormalised partial (acc, max, sum).
    out_off = split.to(tl.int64) * so_s + row[:, None] * so_n + head[:, None] * so_h + d[None, :]
    out_mask = g_ok[:, None] & d_ok[None, :]
    if PARTIAL:
        # A split past a short context's keys leaves its accumulator unwritten: the merge
        # reads only those whose maximum is finite. The first always writes (a sink).
        written = tl.where((kv_lo < kv_hi) | (split == 0), G, 0)
        tl.store(out_ptr + out_off, acc, mask=(g < written)[:, None] & d_ok[None, :])
        ml_off = split.to(tl.int64) * sm_s + row * sm_n + head
        tl.store(m_ptr + ml_off, m_i, mask=g_ok)
        tl.store(l_ptr + ml_off, l_i, mask=g_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@_kernel
def _merge_splits_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr,
    so_n, so_h, sa_s, sa_n, sa_h, sm_s, sm_n, num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # a slice of wide rows
    sp_ok = sp < num_splits
    d_ok = d < head_dim
    # Empty splits hold max -inf and sum 0: their weight below is exactly 0, and their
    # accumulators are not read (a graph captured for a long bound splits a short context
    # into mostly empty pieces).
    m = tl.load(m_ptr + sp * sm_s + row * sm_n + head, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + sp * sm_s + row * sm_n + head, mask=sp_ok, other=0.0)
    held = sp_ok & (m > float("-inf"))
    acc = tl.load(acc_ptr + sp[:, None] * sa_s + row * sa_n + head * sa_h + d[None, :],
                  mask=held[:, None] & d_ok[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + row * so_n + head * so_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any count is correct, a small one keeps test grids small


@functools.cache
def _shared_memory(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0)


def prefill_tuning(q: torch.Tensor) -> dict:
    """A prefill step's tile, by its tokens and head dim (``PREFILL_LONG_TUNING``; 16-bit
    queries: float32 tiles take twice the shared memory)."""
    tokens, _, head_dim = q.shape
    if tokens >= LONG_PREFILL and head_dim in PREFILL_LONG_TUNING and q.element_size() == 2 \
            and q.device.type == "cuda" and _shared_memory(q.device) >= LONG_PREFILL_SMEM:
        return PREFILL_LONG_TUNING[head_dim]
    return TUNING["prefill"]


def decode_tuning(head_dim: int, group: int, fp8_cache: bool = False) -> dict:
    tune = DECODE_TUNING.get((head_dim, group), TUNING["decode"])
    return dict(tune, **FP8_TILE) if fp8_cache and tune["dot"] else tune


def num_splits(attn, num_kv_heads: int, num_sms: int, tune: dict,
               window: int = NO_WINDOW) -> int:
    """Split decode contexts (or windows) until the grid has ``tune["programs_per_sm"]``
    programs per SM, in at most ``tune["max_splits"]`` pieces (or MAX_SPLITS): many
    programs per SM hide a decode program's load latency. From the context bound, not the
    contexts: a CUDA graph captured for the bound splits each sequence's own context that
    many ways (the kernel), and the pieces past a short one exit at once."""
    if not attn.is_decode:
        return 1  # prefill chunks give programs enough; the kernel relies on this
    wanted = triton.cdiv(tune["programs_per_sm"] * num_sms, attn.num_seqs * num_kv_heads)
    keys = min(attn.max_context_len, window)
    splits = max(1, min(wanted, keys // MIN_SPLIT_LEN, tune.get("max_splits", MAX_SPLITS)))
    # A power of two: shares of a power-of-two context come out equal (17 splits of a 32k
    # context ran 4 % slower than 16 on an H200).
    return 1 << (splits.bit_length() - 1)


class TritonPagedAttention:
    # Every launch depends only on (N, S), never on host copies of the
    # metadata: steps with prefill chunks can be captured as CUDA graphs.
    mixed_graphs = True

    def supports(self, device) -> bool:
        return triton_usable(device)

    def forward(self, q, k_cache, v_cache, attn, scale, window=None, sinks=None, softcap=None):
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        assert k_cache.stride() == v_cache.stride()
        group = num_heads // num_kv_heads
        fp8_cache = k_cache.dtype == torch.float8_e4m3fn
        tune = decode_tuning(head_dim, group, fp8_cache) if attn.is_decode else \
            prefill_tuning(q)
        const = {"G": group, "BLOCK_SIZE": k_cache.shape[2],
                 "BLOCK_N": tune["block_n"], "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
                 "num_warps": tune["num_warps"], "num_stages": tune["num_stages"],
                 "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
                 "PDL": dependent_launch(q.device, n),
                 # e4m3 widens to float16 in one instruction, to bfloat16 in three: over an
                 # FP8 cache a 16-bit query computes in float16 (docs/kernels.md)
                 "KV_FP16": fp8_cache and q.element_size() == 2, "HAS_SINKS": sinks is not None,
                 "SOFTCAP": softcap is not None}
        const["launch_pdl"] = const["PDL"]
        scale_log2 = scale * math.log2(math.e)
        sinks = q if sinks is None else sinks  # a pointer the kernels never read without sinks
        softcap_log2 = (softcap or 1.0) * math.log2(math.e)
        if v_cache is k_cache:  # latent attention's rows (layers/mla.py): keys and values
            if window or const["HAS_SINKS"] or softcap:
                raise NotImplementedError("latent attention takes no window, sinks or soft cap")
            return self._latent(q, k_cache, attn, scale_log2, const)
        out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if attn.is_decode:
            self._decode(q, k_cache, v_cache, out, attn, scale_log2, const, tune,
                         window or NO_WINDOW, sinks, softcap_log2)
            return out
        # Prefill chunks give programs enough: never split.
        block_m = max(tune["block_m"], triton.next_power_of_2(const["G"]))
        block_q = block_m // const["G"]
        _paged_attention_kernel[(n // block_q + attn.num_seqs, num_kv_heads)](
            q, k_cache, v_cache, out, attn.block_tables, attn.context_lens, attn.query_start,
            *q.stride(), *out.stride()[:2], *k_cache.stride(), attn.block_tables.stride(0),
            attn.block_tables.shape[1] * k_cache.shape[2], attn.num_seqs, head_dim, scale_log2,
            window or NO_WINDOW, sinks, softcap_log2,
            attn.context_lens if attn.visible is None else attn.visible,
            BLOCK_M=block_m, BLOCK_Q=block_q, HAS_WINDOW=bool(window),
            HAS_VISIBLE=attn.visible is not None, **const)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, out, attn, scale_log2, const, tune, window, sinks,
                softcap_log2):
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        splits = num_splits(attn, num_kv_heads, _num_sms(q.device), tune, window)
        if splits == 1:
            dest, m, l = out.unsqueeze(0), out, out  # m, l unused without splits
        else:
            dest = torch.empty(splits, n, num_heads, head_dim, dtype=torch.float32, device=q.device)
            m = torch.empty(splits, n, num_heads, dtype=torch.float32, device=q.device)
            l = torch.empty_like(m)
        _paged_decode_kernel[(n, num_kv_heads, splits)](
            q, k_cache, v_cache, dest, m, l, attn.block_tables, attn.context_lens,
            *q.stride(), *dest.stride()[:3], *m.stride()[:2], *k_cache.stride(),
            attn.block_tables.stride(0), head_dim, scale_log2, splits, window, sinks,
            softcap_log2, BLOCK_G=max(16 if tune["dot"] else 1, triton.next_power_of_2(const["G"])),
            PARTIAL=splits > 1, DOT=tune["dot"], **const)
        if splits > 1:
            _merge(out, dest, m, l, const["PDL"])

    @staticmethod
    def _latent(q, cache, attn, scale_log2, const):
        tune = LATENT_TUNING["decode"]
        head_blocks = triton.cdiv(q.shape[1], head_block(q.shape[1], tune))
        splits = num_splits(attn, head_blocks, _num_sms(q.device), tune)
        out = latent_attention(q, cache, attn, scale_log2, splits, const["PDL"],
                               const["DOT_PRECISION"])
        if splits == 1:
            return out
        merged = torch.empty_like(q, memory_format=torch.contiguous_format)
        _merge(merged, *out, const["PDL"])
        return merged


def _merge(out, dest, m, l, pdl: bool) -> None:
    """Split decode partials (``dest``, maxima ``m``, sums ``l``) into ``out``: a program
    a row and head, and a slice of its dims where rows are wide (latent attention's 576:
    64 splits of a whole row are more registers than a program has)."""
    splits, n, num_heads, head_dim = dest.shape
    block_d = min(triton.next_power_of_2(head_dim), MERGE_DIMS)
    _merge_splits_kernel[(n, num_heads, triton.cdiv(head_dim, block_d))](
        out, dest, m, l, *out.stride()[:2], *dest.stride()[:3], *m.stride()[:2],
        splits, head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, PDL=pdl,
        launch_pdl=pdl)


@hookimpl
def roseinfer_register_attention_backends(register):
    if triton is not None:
        register("triton_paged", TritonPagedAttention)
