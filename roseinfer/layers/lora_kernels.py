"""Batched LoRA products, in the Punica/S-LoRA design: one step's rows may each use a
different adapter (or none), and every adapter's product for a projection is one shrink
launch and one expand launch.

The adapters live in a fixed table of slots (layers/lora.py): ``a`` is [slices, slots,
rank, in], ``b`` is [slices, slots, out, rank], the scaling folded into ``b``. A fused
projection (q/k/v, gate/up) has a slice per part, each with its own A and B, so its
parts' products still take one launch each way.

Tokens are grouped by slot once per forward (``LoraBatch``): a stable sort of the
tokens by slot, then each run of one slot's tokens. A program takes a tile of one run,
so each adapter's weights are read once per tile of its tokens, and a tile's product
runs on tensor cores. The grid spans min(tokens, slots + 1) runs, fixed by the token
count, so a CUDA graph holds it; runs past the last one, the tokens with no adapter,
and tiles past a run's length exit at once.

The shrink splits its inner dimension (``split_k``): one slot's A is a few hundred KB,
too much for one program at batch 1, and a prompt's tile would walk all of it alone. Its partial products are summed by
the expand, which reads them anyway: no atomics and no zeroing launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.core.triton_support import dependent_launch, kernel, tl, triton, wait_for_inputs

DECODE_MAX_TOKENS = 64  # up to this many tokens a tile holds 16 of them, else 64
# By the most tokens they serve: (inner-dimension elements per split, most splits, the
# shrink's inner block, the expand's output block). Chosen by docs/bench/lora_kernels.py's
# sweep on an H200 (docs/kernels.md, "LoRA"): few tokens want one short pass over a
# split, more want fewer, wider expand programs; prompts want a split too, or a tile's
# program walks the whole inner dimension alone.
TILES = ((8, (256, 64, 256, 64)), (DECODE_MAX_TOKENS, (512, 8, 128, 256)),
         (1 << 62, (1024, 16, 128, 128)))


@dataclass
class LoraBatch:
    """The step's tokens by adapter slot: ``slots`` [tokens] (-1: none), and (grouped on
    first use) the runs of one slot in the tokens sorted by slot."""
    slots: torch.Tensor
    num_slots: int
    _grouped: tuple | None = None
    _rows: list | None = None

    def grouped(self) -> tuple[torch.Tensor, ...]:
        """(order, slot, start, count): the tokens sorted by slot, then per run of one slot
        in that order its slot (-1: the tokens with none, or past the last run), first
        index and length. There are at most min(tokens, slots + 1) runs, so a grid over
        runs is one program wide at batch 1, where a grid over slots is ``slots`` wide and
        all but one of its programs exit. Computed on the device once per forward."""
        if self._grouped is None:
            tokens, none = self.slots.shape[0], self.num_slots
            key = torch.where(self.slots < 0, none, self.slots).long()
            key, order = torch.sort(key, stable=True)
            new = torch.ones_like(key, dtype=torch.bool)
            new[1:] = key[1:] != key[:-1]
            run = torch.cumsum(new, 0) - 1
            slot = torch.full((tokens,), -1, dtype=torch.int32, device=key.device)
            slot.scatter_(0, run, torch.where(key == none, -1, key).to(torch.int32))
            count = torch.zeros(tokens, dtype=torch.int32, device=key.device)
            count.scatter_add_(0, run, torch.ones_like(count))
            start = torch.cumsum(count, 0, dtype=torch.int32) - count
            runs = min(tokens, none + 1)
            self._grouped = (order.to(torch.int32), slot[:runs], start[:runs].to(torch.int32),
                             count[:runs])
        return self._grouped

    def rows(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its tokens) of each slot in use, read on the host (the torch path)."""
        if self._rows is None:
            self._rows = [(slot, (self.slots == slot).nonzero().squeeze(1))
                          for slot in self.slots.unique().tolist() if slot >= 0]
        return self._rows


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             offsets: tuple[int, ...], ends: torch.Tensor, batch: LoraBatch,
             use_triton: bool | None = None) -> None:
    """``y[t, offsets[s]:offsets[s + 1]] += x[t] @ a[s, slot]^T @ b[s, slot]^T`` for every
    token t whose slot is not -1, in place. ``x`` [tokens, in], ``y`` [tokens, out];
    ``ends``: ``offsets`` as an int32 tensor on their device."""
    if use_triton is None:
        use_triton = x.is_cuda and triton is not None
    if use_triton:
        _add_triton(y, x, a, b, offsets, ends, batch)
    else:
        _add_torch(y, x, a, b, offsets, batch)


def _add_torch(y, x, a, b, offsets, batch: LoraBatch) -> None:
    """One slot at a time: on the CPU the host may read which slots the step uses."""
    for slot, rows in batch.rows():
        xs = x[rows]
        for s in range(a.shape[0]):
            lo, hi = offsets[s], offsets[s + 1]
            y[rows, lo:hi] += (xs @ a[s, slot].T) @ b[s, slot, :hi - lo].T


def _block_m(tokens: int) -> int:
    return 16 if tokens <= DECODE_MAX_TOKENS else 64


def _add_triton(y, x, a, b, offsets, ends, batch: LoraBatch) -> None:
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    part = shrink(x, a, batch)
    tokens, slices, rank = x.shape[0], a.shape[0], a.shape[2]
    block_n = _tiling(tokens)[3]
    block_m, pdl = _block_m(tokens), dependent_launch(x.device, tokens)
    order, run_slot, starts, counts = batch.grouped()
    runs = run_slot.shape[0]
    y2 = y.view(-1, y.shape[-1])
    n_tiles = triton.cdiv(max(offsets[i + 1] - offsets[i] for i in range(slices)), block_n)
    _expand_kernel[(triton.cdiv(tokens, block_m), n_tiles, slices * runs)](
        part, b, y2, ends, order, run_slot, counts, starts,
        rank, runs, part.stride(0), part.stride(1), part.stride(2),
        b.stride(0), b.stride(1), b.stride(2), y2.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
        BLOCK_R=part.shape[3], SPLIT=part.shape[0], PDL=pdl, launch_pdl=pdl)


def _tiling(tokens: int) -> tuple[int, int, int, int]:
    return next(t for most, t in TILES if tokens <= most)


def shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """The shrink's float32 partials [splits, slices, tokens, rank padded to 16 or a power
    of two]: their sum over splits is x @ a[slice, slot]^T for each token with a slot.
    ``x``: [tokens, in], unit column stride."""
    tokens, n_in = x.shape
    slices, rank = a.shape[0], a.shape[2]
    block_m, block_r = _block_m(tokens), max(16, triton.next_power_of_2(rank))
    per_split, max_split, block_k, _ = _tiling(tokens)
    split = min(max_split, triton.cdiv(n_in, per_split))
    block_k = min(block_k, triton.next_power_of_2(triton.cdiv(n_in, split)))
    part = torch.empty(split, slices, tokens, block_r, dtype=torch.float32, device=x.device)
    pdl = dependent_launch(x.device, tokens)
    order, run_slot, starts, counts = batch.grouped()
    _shrink_kernel[(triton.cdiv(tokens, block_m) * split, slices, run_slot.shape[0])](
        x, a, part, order, run_slot, counts, starts,
        n_in, rank, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        part.stride(0), part.stride(1), part.stride(2), triton.cdiv(n_in, split),
        BLOCK_M=block_m, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, BLOCK_R=block_r,
        SPLIT=split, PDL=pdl, launch_pdl=pdl)
    return part


@kernel
def _run_tile(order_ptr, start_ptr, run, tile, count, BLOCK_M: tl.constexpr):
    """Tile ``tile`` of run ``run``'s tokens (int64 indices) and which of them are real."""
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < count
    tok = tl.load(order_ptr + tl.load(start_ptr + run) + m, mask=m_ok, other=0).to(tl.int64)
    return tok, m_ok


@kernel
def _shrink_kernel(x_ptr, a_ptr, part_ptr, order_ptr, slot_ptr, count_ptr, start_ptr,
                   n_in, rank, s_x, s_a_slice, s_a_slot, s_a_r,
                   s_p_split, s_p_slice, s_p_tok, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr):
    """part[split, slice, token, :] = x[token, split's K range] @ a[slice, slot]^T."""
    wait_for_inputs(PDL)
    pid, s, run = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, split = pid // SPLIT, pid % SPLIT
    slot = tl.load(slot_ptr + run)
    count = tl.load(count_ptr + run)
    if slot >= 0 and tile * BLOCK_M < count:
        tok, m_ok = _run_tile(order_ptr, start_ptr, run, tile, count, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        a_base = a_ptr + s * s_a_slice + slot.to(tl.int64) * s_a_slot
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, n_in)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            xt = tl.load(x_ptr + tok[:, None] * s_x + k[None, :],
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_base + r[None, :] * s_a_r + k[:, None],
                         mask=k_ok[:, None] & (r < rank)[None, :], other=0.0)
            acc += tl.dot(xt, at, input_precision="ieee" if IEEE else None)
        tl.store(part_ptr + split * s_p_split + s * s_p_slice + tok[:, None] * s_p_tok
                 + r[None, :], acc, mask=m_ok[:, None])


@kernel
def _expand_kernel(part_ptr, b_ptr, y_ptr, ends_ptr, order_ptr, slot_ptr, count_ptr, start_ptr,
                   rank, runs, s_p_split, s_p_slice, s_p_tok,
                   s_b_slice, s_b_slot, s_b_n, s_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr):
    """y[token, slice's columns] += (sum of the shrink's splits) @ b[slice, slot]^T."""
    wait_for_inputs(PDL)
    tile, n_tile, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, run = pid // runs, pid % runs
    slot = tl.load(slot_ptr + run)
    count = tl.load(count_ptr + run)
    lo = tl.load(ends_ptr + s)
    width = tl.load(ends_ptr + s + 1) - lo
    if slot >= 0 and tile * BLOCK_M < count and n_tile * BLOCK_N < width:
        tok, m_ok = _run_tile(order_ptr, start_ptr, run, tile, count, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < width
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(SPLIT):
            h += tl.load(part_ptr + split * s_p_split + s * s_p_slice + tok[:, None] * s_p_tok
                         + r[None, :], mask=m_ok[:, None], other=0.0)
        bt = tl.load(b_ptr + s * s_b_slice + slot.to(tl.int64) * s_b_slot + n[None, :] * s_b_n
                     + r[:, None], mask=n_ok[None, :] & (r < rank)[:, None], other=0.0)
        delta = tl.dot(h.to(bt.dtype), bt, input_precision="ieee" if IEEE else None)
        ptrs = y_ptr + tok[:, None] * s_y + lo + n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
