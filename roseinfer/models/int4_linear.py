"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with one scale per group of
128 input columns, ``w = (level - 8) * scale``, eight levels to an int32 word.

The packed weight is laid out for the kernels, K-major as GPTQ's ([K / 8, N]), and within
a group of 128 inputs word r of column n holds inputs r, r + 16, ..., r + 112 (nibble j:
input 16 j + r). Shifting a [16, N] tile of words by 4 j and masking gives the levels of
inputs 16 j .. 16 j + 15 as a [16, N] tile, which is a tensor-core operand as it is: no
reshape or transpose in registers (an interleaved layout, unpacked by a reshape, ran 3x
slower than bf16 on the H100: docs/benchmarks.md).

Decode rows (at most MAX_ROWS) go through a skinny kernel that streams the packed words
once. ``x @ levels`` is exact in float32 (the levels are small integers, exact in
bfloat16), and the group's offset and scale apply to the [rows, columns] partial, not to
each weight: ``sum_k x_k (q_k - 8) s = (x @ q - 8 sum_k x_k) s``. More rows de-quantize
the weight into a float buffer (one more kernel) and go to cuBLAS.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs

MAX_ROWS = 16  # one tile of rows
PACK = 8       # levels per int32 word
GROUP = 128    # inputs per scale; a word row spans GROUP / PACK = 16 of them
SPAN = GROUP // PACK
# BLOCK_N, groups per K step, warps, stages: docs/bench/int4_linears.py on the H100
CONFIG = (32, 2, 4, 4)


@_kernel
def _int4_skinny_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_x, s_q, s_s, s_y,
                        GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    """y = x @ w.T (+ b), ``GROUPS`` groups of K a step; K is a multiple of 128 * GROUPS."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    col_ok, row_ok = cols < N, rows < M
    r = tl.arange(0, 16)  # word rows of a group
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 128 * GROUPS):
        for g in tl.static_range(GROUPS):
            start = k0 + g * 128
            words = tl.load(q_ptr + (start // 8 + r)[:, None] * s_q + cols[None, :],
                            mask=col_ok[None, :], other=0)
            part = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([16], dtype=tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_ptr + rows[:, None] * s_x + (start + 16 * j + r)[None, :],
                            mask=row_ok[:, None], other=0.0)
                levels = ((words >> (4 * j)) & 0xF).to(x.dtype)
                part = tl.dot(x, levels, part, input_precision=PRECISION)
                x_sum += tl.sum(x.to(tl.float32), 1)
            scale = tl.load(s_ptr + (start // 128) * s_s + cols, mask=col_ok, other=0.0)
            acc += (part - 8.0 * x_sum[:, None]) * scale.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@_kernel
def _int4_dot_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_x, s_q, s_s, s_y,
                     GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr):
    """The same product, each group one dot of K 128: input k's word loaded once for each
    of its 8 inputs (from the cache: memory still carries each word once)."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    col_ok, row_ok = cols < N, rows < M
    k = tl.arange(0, 128)
    word_row, shift = k % 16, (k // 16) * 4
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 128 * GROUPS):
        for g in tl.static_range(GROUPS):
            start = k0 + g * 128
            words = tl.load(q_ptr + (start // 8 + word_row)[:, None] * s_q + cols[None, :],
                            mask=col_ok[None, :], other=0)
            x = tl.load(x_ptr + rows[:, None] * s_x + (start + k)[None, :],
                        mask=row_ok[:, None], other=0.0)
            levels = ((words >> shift[:, None]) & 0xF).to(x.dtype)
            part = tl.dot(x, levels, input_precision=PRECISION)
            offset = 8.0 * tl.sum(x.to(tl.float32), 1)
            scale = tl.load(s_ptr + (start // 128) * s_s + cols, mask=col_ok, other=0.0)
            acc += (part - offset[:, None]) * scale.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@_kernel
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_x, s_q, s_s, s_y,
                      GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, PDL: tl.constexpr):
    """One row on the CUDA cores: each weight de-quantized and multiplied in float32."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k = tl.arange(0, 128)
    word_row, shift = k % 16, (k // 16) * 4
    acc = tl.zeros([128, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 128 * GROUPS):
        for g in tl.static_range(GROUPS):
            start = k0 + g * 128
            words = tl.load(q_ptr + (start // 8 + word_row)[:, None] * s_q + cols[None, :],
                            mask=col_ok[None, :], other=0)
            x = tl.load(x_ptr + start + k).to(tl.float32)
            scale = tl.load(s_ptr + (start // 128) * s_s + cols, mask=col_ok, other=0.0)
            w = (((words >> shift[:, None]) & 0xF) - 8).to(tl.float32) * \
                scale.to(tl.float32)[None, :]
            acc += x[:, None] * w
    y = tl.sum(acc, 0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


@_kernel
def _dequantize_kernel(q_ptr, s_ptr, w_ptr, N, s_q, s_s, s_w, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    """Group ``program_id(1)`` of ``BLOCK_N`` columns of the float weight, written K-major
    ([K, N]: coalesced)."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    ok = cols < N
    r = tl.arange(0, 16)
    words = tl.load(q_ptr + (group * 16 + r)[:, None] * s_q + cols[None, :], mask=ok[None, :],
                    other=0)
    scale = tl.load(s_ptr + group * s_s + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        w = (((words >> (4 * j)) & 0xF) - 8).to(tl.float32) * scale[None, :]
        k = group * 128 + 16 * j + r
        tl.store(w_ptr + k[:, None] * s_w + cols[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=ok[None, :])


def pack(levels: torch.Tensor) -> torch.Tensor:
    """Levels 0..15 [N, K] -> int32 words [K / 8, N] in the kernels' layout (module doc)."""
    n, k = levels.shape
    # [groups, nibble j, word row r, N]: input 16 j + r of each group
    parts = levels.t().reshape(k // GROUP, PACK, SPAN, n).long()
    shifts = (torch.arange(PACK, device=levels.device) * 4).view(1, PACK, 1, 1)
    words = (parts << shifts).sum(1).reshape(k // PACK, n)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: int32 words [K / 8, N] -> levels [N, K] (int32)."""
    k, n = words.shape[0] * PACK, words.shape[1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device).view(1, PACK, 1, 1)
    parts = (words.view(k // GROUP, 1, SPAN, n) >> shifts) & 0xF  # [groups, j, r, N]
    return parts.reshape(k, n).t().contiguous()


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per group: (levels 0..15 [N, K], scales [N, K / group]
    float32 holding float16 values, as the kernels keep them), each group's largest
    magnitude at level 8 +- 7."""
    groups = w.float().view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-7).half().float()
    levels = (groups / scale).round().clamp(-8, 7) + 8
    return levels.view_as(w).to(torch.int32), scale.squeeze(-1)


def dequantize(levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = levels.shape[1] // scale.shape[1]
    return (levels.float() - 8) * scale.float().repeat_interleave(group, 1)


def int4_skinny_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, config=None,
                       variant: str = "split") -> torch.Tensor:
    """The W4A16 product of a 2-D ``x`` of at most MAX_ROWS rows (unit column strides)
    with packed ``qweight`` [K / 8, N] and float16 ``scales`` [K / 128, N]."""
    m, k = x.shape
    n = qweight.shape[1]
    block_n, groups, warps, stages = config or CONFIG
    while (k // GROUP) % groups:
        groups //= 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device, m)
    kernel = {"split": _int4_skinny_kernel, "dot": _int4_dot_kernel,
              "gemv": _int4_gemv_kernel}[variant]
    kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, bias if bias is not None else scales, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUPS=groups, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] (a view of a K-major buffer), one launch."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    pdl = dependent_launch(qweight.device, n)
    _dequantize_kernel[(triton.cdiv(n, 64), k // GROUP)](
        qweight, scales, w, n, qweight.stride(0), scales.stride(0), w.stride(0),
        BLOCK_N=64, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return w.t()


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is ``qweight`` (packed levels) and ``scales``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS and rows.stride(1) == 1:
            y = int4_skinny_linear(rows, self.qweight, self.scales, self.bias)
        else:
            y = F.linear(rows, dequantize_weight(self.qweight, self.scales, x.dtype), self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def runs_here(device: torch.device) -> bool:
    """bfloat16 tensor-core dots: compute capability 8.0 (Ampere) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def to_int4(linear: nn.Linear) -> None:
    """Make ``linear`` (float weights, on CUDA, inputs a multiple of 128) an Int4Linear in
    place: its weight rounded per group of 128 inputs (``quantize``), the float copy
    freed. Scales are float16, as AWQ and GPTQ store them."""
    levels, scale = quantize(linear.weight.detach(), GROUP)
    del linear.weight
    # parameters (not buffers): what reads a model's weights (the bench's bytes floor,
    # a state dict) finds them
    linear.qweight = nn.Parameter(pack(levels), requires_grad=False)
    linear.scales = nn.Parameter(scale.t().contiguous().half(), requires_grad=False)
    linear.__class__ = Int4Linear
