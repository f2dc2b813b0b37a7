"""Sampling on the GPU: temperature, top-k, top-p and min-p for a batch that
mixes greedy and sampled rows, with no host sync and no sort.

Each sequence's sampling parameters live in its device row (``WORDS`` int32
words after its block-table entries), written once when it gets the row, so
a step builds nothing per row and a CUDA graph can sample.

One program per row. A sampled row draws by the exponential race (Gumbel-max):
the token with the largest ``logit / T - log(E)``, ``E ~ Exp(1)``. Top-k,
top-p and min-p are applied by rejection (the sorting-free method of
FlashInfer's samplers): every filter keeps an upper set of the logits, so a
drawn token ``x`` is kept iff fewer than ``top_k`` tokens have a larger logit,
their mass is below ``top_p`` and ``p_x >= min_p * p_max``. A rejected ``x``
proves that every token up to its logit is filtered out, so the next round
races only above it. Each round costs one pass over the vocabulary to race
and one to check; a round is accepted with probability at least ``top_p``.

The noise is Philox keyed by the request's seed with the token's position and
the round as counters: a seeded request draws the same tokens whatever else
is in the batch, with or without CUDA graphs, and after a preemption.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import random
import struct

import torch

from roseinfer.core.sampling import SamplingParams
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, wait_for_inputs

_const = tl.constexpr if tl is not None else int  # kernels read only constexpr globals
# Layout of a row's sampling words: floats stored as their bits.
TEMPERATURE, TOP_P, MIN_P, TOP_K, SEED_LO, SEED_HI = map(_const, range(6))
WORDS = 6
MAX_ROUNDS = _const(32)  # past this (vanishingly rare) a row takes its argmax: every filter keeps it
# Columns per tile. Fixed: which Philox word a column's noise comes from
# depends on it (_race), so changing it changes seeded requests' tokens.
BLOCK_V = _const(4096)
QUARTER = _const(1024)
# Launch settings (one program per row); a dict so benchmarks can sweep it.
SAMPLE = {"num_warps": 32}


def words(params: SamplingParams) -> list[int]:
    """A request's sampling words; a request without a seed gets a random one."""
    seed = params.seed if params.seed is not None else random.getrandbits(64)
    seed &= (1 << 64) - 1
    floats = struct.unpack("<3i", struct.pack("<3f", params.temperature, params.top_p,
                                              params.min_p))
    return [*floats, params.top_k, _int32(seed & 0xFFFFFFFF), _int32(seed >> 32)]


def _int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


@_kernel
def _argmax_row(row_ptr, vocab):
    """The first index of the row's maximum, as torch.argmax picks it."""
    cols = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):  # per lane: strict > keeps the earliest index
        v = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
        v = v.to(tl.float32)
        better = v > best
        best = tl.where(better, v, best)
        best_idx = tl.where(better, start + cols, best_idx)
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, best_idx, vocab), 0)


@_kernel
def _race_part(row_ptr, vocab, c, bits, inv_t, pivot, best, best_idx, m, z):
    """Columns ``c`` into the race state (best key and its column per lane, and
    the online max and sum of ``exp((l - max) / T)``); ``bits`` is their noise."""
    ok = c < vocab
    l = tl.load(row_ptr + c, mask=ok, other=float("-inf")).to(tl.float32)
    # Uniform in (0, 1): 23 bits, so that k + 0.5 is exact in float32 (with 24
    # the largest rounds to 1.0, whose Gumbel noise is +inf).
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    key = l * inv_t - tl.log(-tl.log(u))                           # + Gumbel noise
    key = tl.where(ok & (l > pivot), key, float("-inf"))
    better = key > best  # strict: a lane keeps its earliest column on ties
    best = tl.where(better, key, best)
    best_idx = tl.where(better, c, best_idx)
    # -inf logits (and masked lanes) add 0 to the sum.
    m_new = tl.maximum(m, l)
    alpha = tl.where(m_new > float("-inf"), tl.exp((m - m_new) * inv_t), 1.0)
    z = z * alpha + tl.where(l > float("-inf"), tl.exp((l - m_new) * inv_t), 0.0)
    return best, best_idx, m_new, z


@_kernel
def _race(row_ptr, vocab, inv_t, pivot, seed, position, rnd):
    """One round: the winning token among logits above ``pivot``, and over the
    whole row the max logit and the sum of ``exp((l - max) / T)``.

    Philox gives four words per call: lane t of tile ``start`` takes them for
    columns ``start + j * QUARTER + t``, j = 0..3, with counter
    ``(start / 4 + t, position, round)``. The noise of a column depends only on
    (seed, column, position, round)."""
    t = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    m = tl.full([QUARTER], float("-inf"), tl.float32)
    z = tl.zeros([QUARTER], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        c0 = (start // 4 + t).to(tl.uint32)
        zero = c0 * 0
        b0, b1, b2, b3 = tl.philox(seed, c0, (zero + position).to(tl.uint32),
                                   (zero + rnd).to(tl.uint32), zero)
        c = start + t
        best, best_idx, m, z = _race_part(row_ptr, vocab, c, b0, inv_t, pivot, best, best_idx, m, z)
        c += QUARTER
        best, best_idx, m, z = _race_part(row_ptr, vocab, c, b1, inv_t, pivot, best, best_idx, m, z)
        c += QUARTER
        best, best_idx, m, z = _race_part(row_ptr, vocab, c, b2, inv_t, pivot, best, best_idx, m, z)
        c += QUARTER
        best, best_idx, m, z = _race_part(row_ptr, vocab, c, b3, inv_t, pivot, best, best_idx, m, z)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_idx, vocab - 1), 0)
    m_row = tl.max(m, 0)
    z_row = tl.sum(tl.where(m > float("-inf"), z * tl.exp((m - m_row) * inv_t), 0.0), 0)
    return token, m_row, z_row


@_kernel
def _above(row_ptr, vocab, inv_t, lx, m):
    """How many logits exceed ``lx``, and their unnormalised mass."""
    cols = tl.arange(0, BLOCK_V)
    count = tl.zeros([BLOCK_V], tl.int32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        c = start + cols
        l = tl.load(row_ptr + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
        gt = l > lx
        count += gt.to(tl.int32)
        mass += tl.where(gt, tl.exp((l - m) * inv_t), 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@_kernel
def sample_row(row_ptr, vocab, params_ptr, position):
    """The token row ``row_ptr`` samples under the sampling words at ``params_ptr``."""
    temperature = tl.load(params_ptr + TEMPERATURE).to(tl.float32, bitcast=True)
    if temperature == 0:
        return _argmax_row(row_ptr, vocab)
    top_p = tl.load(params_ptr + TOP_P).to(tl.float32, bitcast=True)
    min_p = tl.load(params_ptr + MIN_P).to(tl.float32, bitcast=True)
    top_k = tl.load(params_ptr + TOP_K)
    seed = (tl.load(params_ptr + SEED_LO).to(tl.uint32, bitcast=True).to(tl.uint64)
            | (tl.load(params_ptr + SEED_HI).to(tl.uint32, bitcast=True).to(tl.uint64) << 32))
    inv_t = 1.0 / temperature
    filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    pivot = float("-inf")
    token = -1
    rnd = 0
    while token < 0:
        x, m, z = _race(row_ptr, vocab, inv_t, pivot, seed, position, rnd)
        token = x
        if filtered:
            lx = tl.load(row_ptr + x).to(tl.float32)
            count, mass = _above(row_ptr, vocab, inv_t, lx, m)
            kept = (((top_k == 0) | (count < top_k)) & (mass < top_p * z)
                    & (tl.exp((lx - m) * inv_t) >= min_p))
            token = tl.where(kept, x, -1)
            pivot = tl.where(kept, pivot, lx)
        rnd += 1
        if (token < 0) & (rnd == MAX_ROUNDS):
            token = _argmax_row(row_ptr, vocab)
    return token


@_kernel
def _sample_kernel(logits_ptr, s_logits, vocab, out_ptr, seq_state_ptr, s_state, params_col,
                   sample_seq_rows_ptr, sample_idx_ptr, positions_ptr, position_shift,
                   PDL: tl.constexpr):
    wait_for_inputs(PDL)
    k = tl.program_id(0)
    params = (seq_state_ptr + tl.load(sample_seq_rows_ptr + k).to(tl.int64) * s_state
              + params_col)
    position = tl.load(positions_ptr + tl.load(sample_idx_ptr + k)) + position_shift
    token = sample_row(logits_ptr + k.to(tl.int64) * s_logits, vocab, params, position)
    tl.store(out_ptr + k, token)


def sample(logits: torch.Tensor, inp, seq_state: torch.Tensor, params_col: int,
           position_shift: int = 0) -> torch.Tensor:
    """Row k of ``logits`` sampled under the words of sequence row
    ``inp.sample_seq_rows[k]``, keyed by the position of token ``inp.sample_idx[k]``
    (plus ``position_shift``: -1 after a decode graph has moved the inputs on)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    pdl = dependent_launch(logits.device, rows)
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, out, seq_state, seq_state.stride(0),
                            params_col, inp.sample_seq_rows, inp.sample_idx, inp.positions,
                            position_shift, PDL=pdl, num_warps=SAMPLE["num_warps"],
                            launch_pdl=pdl)
    return out
