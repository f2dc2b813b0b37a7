"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with one scale per group of
``group`` input columns, ``w = (level - 8) * scale``, packed eight to an int32 word (column
8i + j in bits 4j..4j+3 of word i), so a weight crosses memory at half a byte.

Decode rows (at most MAX_ROWS) go through a skinny kernel that streams the packed words
once and multiplies each group's levels on the tensor cores: ``x @ levels`` is exact in
float32 (the levels are small integers, exact in bfloat16), and the group's offset and
scale apply to the [rows, columns] partial, not to each weight:
``sum_k x_k (q_k - 8) s = (x @ q - 8 sum_k x_k) s``. More rows de-quantize the weight
into a float buffer once per call (one more kernel) and go to cuBLAS.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs

MAX_ROWS = 16  # one tile of rows
PACK = 8       # levels per int32 word
# BLOCK_N, groups per K step, warps, stages: docs/bench/int4_linears.py on the H100
CONFIG = (32, 4, 4, 4)


@_kernel
def _int4_skinny_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_x, s_q, s_s, s_y,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """y = x @ w.T (+ b), ``GROUPS`` groups of K a step; K is a multiple of GROUP * GROUPS."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    col_ok, row_ok = cols < N, rows < M
    words = tl.arange(0, GROUP // 8)
    shifts = tl.arange(0, 8) * 4
    ks = tl.arange(0, GROUP)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, GROUP * GROUPS):
        for g in tl.static_range(GROUPS):
            start = k0 + g * GROUP
            packed = tl.load(q_ptr + cols[:, None] * s_q + (start // 8 + words)[None, :],
                             mask=col_ok[:, None], other=0)
            levels = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
            x = tl.load(x_ptr + rows[:, None] * s_x + (start + ks)[None, :],
                        mask=row_ok[:, None], other=0.0)
            w = tl.reshape(levels, [BLOCK_N, GROUP]).to(x.dtype)
            part = tl.dot(x, tl.trans(w), input_precision=PRECISION)
            offset = 8.0 * tl.sum(x.to(tl.float32), 1)
            scale = tl.load(s_ptr + cols * s_s + start // GROUP, mask=col_ok, other=0.0)
            acc += (part - offset[:, None]) * scale.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@_kernel
def _dequantize_kernel(q_ptr, s_ptr, w_ptr, N, s_q, s_s, s_w, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Group ``program_id(1)`` of ``BLOCK_N`` rows of the float weight."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    ok = cols < N
    words = group * (GROUP // 8) + tl.arange(0, GROUP // 8)
    packed = tl.load(q_ptr + cols[:, None] * s_q + words[None, :], mask=ok[:, None], other=0)
    levels = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    scale = tl.load(s_ptr + cols * s_s + group, mask=ok, other=0.0).to(tl.float32)
    w = (tl.reshape(levels, [BLOCK_N, GROUP]) - 8).to(tl.float32) * scale[:, None]
    k = group * GROUP + tl.arange(0, GROUP)
    tl.store(w_ptr + cols[:, None] * s_w + k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=ok[:, None])


def pack(levels: torch.Tensor) -> torch.Tensor:
    """Levels 0..15 [N, K] -> int32 words [N, K / 8], column 8i + j in bits 4j.."""
    n, k = levels.shape
    parts = levels.view(n, k // PACK, PACK).long() << (torch.arange(PACK, device=levels.device) * 4)
    words = parts.sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: int32 words [N, K / 8] -> levels [N, K] (int32)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


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
                       bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """The W4A16 product of a 2-D ``x`` of at most MAX_ROWS rows (unit column strides)
    with packed ``qweight`` [N, K / 8] and ``scales`` [N, K / group]."""
    m, k = x.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    block_n, groups, warps, stages = config or CONFIG
    while (k // group) % groups:
        groups //= 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device, m)
    _int4_skinny_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, bias if bias is not None else scales, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, GROUPS=groups, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K], one launch."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    groups = scales.shape[1]
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    pdl = dependent_launch(qweight.device, n)
    _dequantize_kernel[(triton.cdiv(n, 64), groups)](
        qweight, scales, w, n, qweight.stride(0), scales.stride(0), w.stride(0),
        GROUP=k // groups, BLOCK_N=64, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return w


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is ``qweight`` (packed levels) and ``scales``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS and rows.stride(1) == 1:
            y = int4_skinny_linear(rows, self.qweight, self.scales, self.bias)
        else:
            w = dequantize_weight(self.qweight, self.scales, x.dtype)
            y = F.linear(rows, w, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def runs_here(device: torch.device) -> bool:
    """bfloat16 tensor-core dots: compute capability 8.0 (Ampere) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def to_int4(linear: nn.Linear, group: int) -> None:
    """Make ``linear`` (float weights, on CUDA) an Int4Linear in place: its weight rounded
    per group of ``group`` columns (``quantize``), the float copy freed. Scales are
    float16, as AWQ and GPTQ store them."""
    levels, scale = quantize(linear.weight.detach(), group)
    del linear.weight
    linear.register_buffer("qweight", pack(levels))
    linear.register_buffer("scales", scale.half())
    linear.__class__ = Int4Linear
