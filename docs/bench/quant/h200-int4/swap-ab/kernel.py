"""W4A16 kernels over one packed layout: levels 0..15 in int32 words ``[N, K / 8]``,
each row's words in tiles of 16 covering 128 inputs, nibble j of a tile's word i
holding input 16 j + i. One shift and mask of a [BLOCK_N, 16] tile of words then
give the levels of 16 consecutive inputs for every column: an operand a dot takes as
it stands, with no shuffle in registers.

The weight is the dot's left operand and the activations its right one (the product's
transpose, ``y.T = w @ x.T``): so the decode rows fill the small side of the
tensor-core tile, and the weight, converted in registers, never goes through shared
memory. Scales and shifts (``w = level * scale + shift``) are applied per group of
inputs after the dot: ``y = scale * (levels . x) + shift * sum(x)``.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch

from roseinfer.core.triton_support import dependent_launch, kernel, tl, triton, \
    wait_for_inputs

TILE = 128  # inputs per tile of 16 words


def pack(levels: torch.Tensor) -> torch.Tensor:
    """Levels [N, K] (0..15, K a multiple of TILE) -> the int32 words [N, K / 8]."""
    n, k = levels.shape
    planes = levels.to(torch.int64).view(n, k // TILE, 8, 16)
    words = sum(planes[:, :, j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # int32's bits
    return words.to(torch.int32).reshape(n, k // 8)


def unpack_levels(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack``: levels [N, K] int32."""
    n, r = words.shape
    w = words.view(n, r // 16, 1, 16)
    shifts = 4 * torch.arange(8, device=words.device).view(1, 1, 8, 1)
    return ((w >> shifts) & 15).reshape(n, r * 8)


@kernel
def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, s_x, s_y,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  SPLIT: tl.constexpr, MAGIC: tl.constexpr, XDOT: tl.constexpr,
                  PDL: tl.constexpr):
    """y [M, N] = x [M, K] @ w.T, BLOCK_N columns of w and every row of x a program,
    over 1 / SPLIT of K (SPLIT > 1: y float32, zeroed, added to atomically). MAGIC:
    levels become bf16 by setting 128's exponent bits (128 + level) instead of a
    conversion, and 128 * sum(x) comes off after."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    i = tl.arange(0, 16)
    tiles = K // 128
    per = tl.cdiv(tiles, SPLIT)
    first = tl.program_id(1) * per
    last = tl.minimum(first + per, tiles)
    cmask = cols < N
    rmask = rows[None, :] < M
    words_at = q_ptr + cols[:, None].to(tl.int64) * (K // 8) + i[None, :]
    x_at = x_ptr + rows[None, :] * s_x + i[:, None]
    meta_at = cols * (K // GROUP)
    PLANES: tl.constexpr = GROUP // 16
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(first, last):
        words = tl.load(words_at + t * 16, mask=cmask[:, None], other=0)
        for g in tl.static_range(128 // GROUP):
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            if XDOT:
                xsum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            else:
                xsum = tl.zeros([1, BLOCK_M], dtype=tl.float32)
            for p in tl.static_range(PLANES):
                j = g * PLANES + p
                if MAGIC:
                    bits = ((words >> (4 * j)) & 15) | 0x4300
                    levels = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
                else:
                    levels = ((words >> (4 * j)) & 15).to(x_ptr.dtype.element_ty)
                x = tl.load(x_at + t * 128 + j * 16, mask=rmask, other=0.0)
                part = tl.dot(levels, x, part)
                if XDOT:  # the sums on the tensor cores, in the products' layout
                    xsum = tl.dot(tl.full([BLOCK_N, 16], 1.0, x.dtype), x, xsum)
                else:
                    xsum += tl.sum(x.to(tl.float32), axis=0)[None, :]
            meta = meta_at + t * (128 // GROUP) + g
            scale = tl.load(s_ptr + meta, mask=cmask, other=0.0).to(tl.float32)
            shift = tl.load(z_ptr + meta, mask=cmask, other=0.0).to(tl.float32)
            if MAGIC:
                shift -= 128 * scale
            acc += part * scale[:, None] + shift[:, None] * xsum
    out = y_ptr + rows[None, :] * s_y + cols[:, None]
    mask = cmask[:, None] & rmask
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@kernel
def _w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       MAGIC: tl.constexpr, PDL: tl.constexpr):
    """One row on CUDA cores: y [1, N] = x [1, K] @ w.T, products kept [BLOCK_N, 16]
    and summed once at the end. MAGIC: a level becomes float32 by setting 2^23's
    exponent bits (2^23 + level) and subtracting 2^23, instead of a conversion."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, 16)
    tiles = K // 128
    per = tl.cdiv(tiles, SPLIT)
    first = tl.program_id(1) * per
    last = tl.minimum(first + per, tiles)
    cmask = cols < N
    words_at = q_ptr + cols[:, None].to(tl.int64) * (K // 8) + i[None, :]
    meta_at = cols * (K // GROUP)
    PLANES: tl.constexpr = GROUP // 16
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    shifted = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        words = tl.load(words_at + t * 16, mask=cmask[:, None], other=0)
        for g in tl.static_range(128 // GROUP):
            part = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            xsum = 0.0
            for p in tl.static_range(PLANES):
                j = g * PLANES + p
                if MAGIC:
                    bits = ((words >> (4 * j)) & 15) | 0x4B000000
                    levels = bits.to(tl.float32, bitcast=True) - 8388608.0
                else:
                    levels = ((words >> (4 * j)) & 15).to(tl.float32)
                x = tl.load(x_ptr + t * 128 + j * 16 + i).to(tl.float32)
                part += levels * x[None, :]
                xsum += tl.sum(x)
            meta = meta_at + t * (128 // GROUP) + g
            scale = tl.load(s_ptr + meta, mask=cmask, other=0.0).to(tl.float32)
            shift = tl.load(z_ptr + meta, mask=cmask, other=0.0).to(tl.float32)
            acc += part * scale[:, None]
            shifted += shift * xsum
    y = tl.sum(acc, axis=1) + shifted
    if SPLIT == 1:
        tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.atomic_add(y_ptr + cols, y, mask=cmask)


def w4a16(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
          block_n: int, split: int = 1, magic: bool = False, gemv: bool = False,
          xdot: bool = False, warps: int = 4, stages: int = 3) -> torch.Tensor:
    """x [M, K] @ w.T for w packed (``words`` [N, K / 8], ``scales`` and ``shifts``
    [N, K / group] in x's dtype), in one launch (two more with split > 1: the zeroed
    float32 sums, and their rounding)."""
    m, k = x.shape
    n = words.shape[0]
    group = k // scales.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.zeros(m, n, dtype=torch.float32, device=x.device)
    pdl = dependent_launch(x.device, m)
    grid = (triton.cdiv(n, block_n), split)
    if gemv:
        assert m == 1
        _w4a16_gemv_kernel[grid](x, words, scales, shifts, y, n, k, GROUP=group,
                                 BLOCK_N=block_n, SPLIT=split, MAGIC=magic, PDL=pdl,
                                 num_warps=warps, num_stages=stages, launch_pdl=pdl)
    else:
        _w4a16_kernel[grid](x, words, scales, shifts, y, m, n, k, x.stride(0), y.stride(0),
                            GROUP=group, BLOCK_N=block_n,
                            BLOCK_M=max(16, triton.next_power_of_2(m)), SPLIT=split,
                            MAGIC=magic, XDOT=xdot, PDL=pdl, num_warps=warps, num_stages=stages,
                            launch_pdl=pdl)
    return y if split == 1 else y.to(x.dtype)
