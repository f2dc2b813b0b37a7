"""Linears of few rows on CUDA: decode at small batch, where a step's time is its
weight bytes. One Triton kernel streams each weight once: every program owns
``BLOCK_N`` output columns, walks the whole of K, and multiplies all the rows
(padded to one tile of 16) on the tensor cores.

It runs on Hopper GPUs, where its settings were swept (docs/kernels.md, "Skinny
linears"), on the weight shapes where cuBLAS is not clearly faster: timed when the
model loads, since neither wins everywhere. On an H100 it wins on every linear of the
Llama-3 1B and 8B shapes and loses where its grid ends in a mostly idle wave
(Phi-3-mini's qkv, 1.16x cuBLAS's time). Launched as a dependent
(``dependent_launch``) it starts while the kernel before it drains, which cuBLAS's
kernels do not. From ``MAX_ROWS`` rows up cuBLAS runs every shape.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import logging
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.arrivals import counters, last_to_arrive, partials
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs

log = logging.getLogger(__name__)
MAX_ROWS = 16        # one tile of rows
BLOCK_N = 32         # columns a program owns
TIMED_ROWS = (1, 4, MAX_ROWS)
# Splits of K timed at load. A weight of few columns gives the SMs too few tiles (the
# Llama-3.2 1B's o_proj and down_proj, 2,048 columns: 64 programs for 132 SMs), so its
# K runs over 2 or 4 programs a tile, the last of which adds the partial sums.
SPLITS = (1, 2, 4)
SPLIT_MARGIN = 0.03
# cuBLAS keeps a shape only where it is this much faster than the kernel, timed alone.
# Its kernels are not launched as dependents, so in a step they also cost the overlap at
# both their ends, which timing alone does not see: preferring the kernel within 2 %
# took 1B's batch-1 step from 1.24-1.30 to 1.21-1.22 ms (docs/kernels.md).
CUBLAS_MARGIN = 0.02


@_kernel
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, xs_ptr, ws_ptr, M, N, K, s_x, s_w, s_y,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
                   PDL: tl.constexpr, lh_ptr=None, lb_ptr=None, lslot_ptr=None,
                   lends_ptr=None, l_rank=0, s_lh_split=0, s_lh_slice=0, s_lh_tok=0,
                   s_lb_slice=0, s_lb_slot=0, s_lb_n=0, LORA: tl.constexpr = False,
                   LORA_SPLIT: tl.constexpr = 1, LORA_SLICES: tl.constexpr = 1,
                   LORA_R: tl.constexpr = 16, part_ptr=None, counter_ptr=None,
                   k_per_split=0, SPLIT: tl.constexpr = 1):
    """y = x @ w.T (+ b). SCALED: x and w hold e4m3 values, multiplied as float16 (which
    holds each exactly), and y is scaled by x's row scales ``xs`` and w's column scales
    ``ws`` (layers/fp8_linear.py). LORA: plus each row's LoRA expand, from the shrink's
    partials ``lh`` (layers/lora_kernels.py), the slots' B ``lb``, the rows' slots and the
    slices' first columns ``lends`` (a tile of columns lies in one slice). SPLIT > 1:
    program (tile, split) sums ``k_per_split`` inputs into ``part`` ([SPLIT, 16, N]
    float32), and the last of a tile's splits to arrive (core/arrivals.py) adds them in
    split order and runs the epilogue."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    k_lo = tl.program_id(1) * k_per_split if SPLIT > 1 else 0
    k_hi = tl.minimum(k_lo + k_per_split, K) if SPLIT > 1 else K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # Addresses rebuilt from k0 each pass: 1.1-1.3x faster on the H100 than
        # advancing pointers, whose loop Triton pipelines worse.
        k = k0 + ks
        w_at = w_ptr + cols[:, None] * s_w + k[None, :]  # int32: the caller checks N * K
        x_at = x_ptr + rows[:, None] * s_x + k[None, :]
        if EVEN_K:
            w = tl.load(w_at, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_at, mask=row_ok[:, None], other=0.0)
        else:
            w = tl.load(w_at, mask=col_ok[:, None] & (k < k_hi)[None, :], other=0.0)
            x = tl.load(x_at, mask=row_ok[:, None] & (k < k_hi)[None, :], other=0.0)
        if SCALED:
            x, w = x.to(tl.float16), w.to(tl.float16)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    last = True
    if SPLIT > 1:  # the tile's epilogue runs in the last of its splits to arrive
        at = rows[:, None] * N + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(part_ptr + tl.program_id(1) * 16 * N + at, acc, mask=ok)
        last = last_to_arrive(counter_ptr + tl.program_id(0), SPLIT)
        if last:
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT):
                acc += tl.load(part_ptr + split * 16 * N + at, mask=ok, other=0.0,
                               cache_modifier=".cg")
    if last:
        if SCALED:
            acc *= tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None] * \
                tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if LORA:
            acc += _lora_expand(lh_ptr, lb_ptr, lslot_ptr, lends_ptr, l_rank, s_lh_split,
                                s_lh_slice, s_lh_tok, s_lb_slice, s_lb_slot, s_lb_n, rows,
                                row_ok, cols, col_ok, tl.program_id(0) * BLOCK_N, LORA_SPLIT,
                                LORA_SLICES, LORA_R)
        tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@_kernel
def _lora_expand(lh_ptr, lb_ptr, lslot_ptr, lends_ptr, rank, s_lh_split, s_lh_slice, s_lh_tok,
                 s_lb_slice, s_lb_slot, s_lb_n, rows, row_ok, cols, col_ok, first_col,
                 SPLIT: tl.constexpr, SLICES: tl.constexpr, R: tl.constexpr):
    """[16, BLOCK_N]: each row's (sum of the shrink's splits) @ B[slice, its slot]^T over
    these columns (0 for a row with no slot), rounded as the expand launch rounds it."""
    s = 0
    for i in tl.static_range(1, SLICES):
        s += (first_col >= tl.load(lends_ptr + i)).to(tl.int32)
    lo = tl.load(lends_ptr + s)
    slot = tl.load(lslot_ptr + rows, mask=row_ok, other=-1)
    use = slot >= 0
    r = tl.arange(0, R)
    h = tl.zeros([16, R], dtype=tl.float32)
    for split in tl.static_range(SPLIT):
        h += tl.load(lh_ptr + split * s_lh_split + s * s_lh_slice + rows[:, None] * s_lh_tok
                     + r[None, :], mask=use[:, None], other=0.0)
    bt = tl.load(lb_ptr + s * s_lb_slice + slot.to(tl.int64)[:, None, None] * s_lb_slot
                 + (cols - lo)[None, :, None] * s_lb_n + r[None, None, :],
                 mask=use[:, None, None] & col_ok[None, :, None] & (r < rank)[None, None, :],
                 other=0.0)
    h = h.to(bt.dtype).to(tl.float32)
    return tl.sum(bt.to(tl.float32) * h[:, None, :], axis=2)


def launch_config(k: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), as chosen by the H100 sweeps (docs/kernels.md):
    K blocks of 1 KiB (512 halves), 4 stages deep on rows of 4096 and more, 3 on
    shorter ones."""
    stages = 4 if k >= 4096 else 3
    return BLOCK_N, min(1024 // element_size, max(16, triton.next_power_of_2(k))), 4, stages


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None,
                  lora: tuple | None = None, split: int = 1) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` of at most MAX_ROWS rows (unit
    column strides); float32 accumulation, output in x's dtype. ``lora``: (the shrink's
    partials, the slots' B, the rows' slots, the slices' bounds, rank) to add each row's
    LoRA product in the same launch (layers/lora.py); every slice bound a multiple of
    BLOCK_N. ``split``: K over that many programs a tile of columns (``split_k``)."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bk, warps, stages = config or launch_config(k, x.element_size())
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device, m)
    tiles = triton.cdiv(n, bn)
    splits, extra = split_k(x.device, tiles, n, k, bk, split)
    _skinny_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else weight, y, weight, weight, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays float32
        SCALED=False, PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl,
        **(_lora_args(*lora) if lora is not None else {}), **extra)
    return y


def split_k(device: torch.device, tiles: int, n: int, k: int, block_k: int,
            split: int) -> tuple[int, dict]:
    """(splits, the kernel's split arguments) for K over at most ``split`` programs a
    tile, each a whole number of K blocks; one split where K is one block or the device's
    counters or partials (core/arrivals.py) cannot hold the launch."""
    if split == 1:  # most shapes: nothing to look up on the way
        return 1, {}
    per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    if splits == 1:
        return 1, {}
    part = partials(device, splits * 16 * n)
    count = counters(device, tiles)
    if part is None or count is None:
        return 1, {}
    return splits, dict(part_ptr=part, counter_ptr=count, k_per_split=per_split,
                        SPLIT=splits)


def _lora_args(part, b, slots, ends, rank) -> dict:
    return dict(lh_ptr=part, lb_ptr=b, lslot_ptr=slots, lends_ptr=ends, l_rank=rank,
                s_lh_split=part.stride(0), s_lh_slice=part.stride(1), s_lh_tok=part.stride(2),
                s_lb_slice=b.stride(0), s_lb_slot=b.stride(1), s_lb_n=b.stride(2), LORA=True,
                LORA_SPLIT=part.shape[0], LORA_SLICES=part.shape[1], LORA_R=part.shape[3])


class SkinnyLinear(nn.Linear):
    """nn.Linear that runs the skinny kernel for inputs of at most ``max_rows`` rows
    (at most MAX_ROWS: set per weight shape by ``use_skinny_linears``)."""

    max_rows = MAX_ROWS
    split = 1  # K over this many programs a tile of columns (chosen with max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.stride(1) == 1:
            return skinny_linear(x, self.weight, self.bias, split=self.split)
        return F.linear(x, self.weight, self.bias)


def measured_on(device: torch.device) -> bool:
    """Hopper (the H100 and H200) is where the launch settings were swept: 3-4 stages of
    48 KiB need its shared memory, and other GPUs have other caches and bandwidth.
    They keep cuBLAS for every linear."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def use_skinny_linears(model: nn.Module, rows_faster=None) -> None:
    """Make the plain half-precision nn.Linears of a CUDA model SkinnyLinears (same
    parameters: only the class changes) up to the row count where the kernel is faster
    on this GPU. ``rows_faster(linears)``: (that count, 0 for none; the split of K) for
    these linears of one shape (default ``skinny_rows``, which times the ways)."""
    by_shape = defaultdict(list)
    for m in model.modules():
        w = m.weight if type(m) is nn.Linear else None
        if w is not None and w.dtype in (torch.float16, torch.bfloat16) and w.is_contiguous() \
                and w.numel() < 2 ** 31:
            by_shape[(*w.shape, m.bias is not None)].append(m)
    for (n, k, _), linears in by_shape.items():
        rows, split = (rows_faster or skinny_rows)(linears)
        log.info("linear %d x %d (%d of them): skinny kernel up to %d rows, K split %d",
                 n, k, len(linears), rows, split)
        for m in linears if rows else ():
            m.__class__ = SkinnyLinear
            m.max_rows, m.split = rows, split


@torch.inference_mode()
def skinny_rows(linears: list[nn.Linear]) -> tuple[int, int]:
    """(rows, split): the split of K (of SPLITS) fastest at one row, by SPLIT_MARGIN over
    fewer, and the largest of TIMED_ROWS up to which the kernel with it runs these
    linears (one shape) at every timed count, unless cuBLAS is more than CUBLAS_MARGIN
    faster; 0 if it is at one row.
    Each way is timed as one CUDA graph of the linears in turn, so that their weights
    come from memory as in a decode step."""
    w = linears[0].weight

    def kernel(x, split):
        return graph_time(lambda: [skinny_linear(x, m.weight, m.bias, split=split)
                                   for m in linears])

    one = torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device)
    split, best = 1, kernel(one, 1)
    for s in SPLITS[1:]:  # a split only where it clearly pays: its sums are one more pass
        t = kernel(one, s)
        if t < (1 - SPLIT_MARGIN) * best:
            split, best = s, t
    kernel_up_to = 0
    for rows in TIMED_ROWS:
        x = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
        cublas = graph_time(lambda: [F.linear(x, m.weight, m.bias) for m in linears])
        if kernel(x, split) > (1 + CUBLAS_MARGIN) * cublas:
            break
        kernel_up_to = rows
    return kernel_up_to, split


def graph_time(fn, replays: int = 3) -> float:
    """Milliseconds of the fastest replay of a CUDA graph of ``fn``."""
    fn()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best
