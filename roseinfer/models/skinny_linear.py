"""Linears of few rows on CUDA: decode at small batch, where a step's time is its
weight bytes. One Triton kernel streams each weight once: every program owns
``BLOCK_N`` output columns, walks the whole of K, and multiplies all the rows
(padded to one tile of 16) on the tensor cores.

It runs on Hopper GPUs, on the shapes where it beat cuBLAS on an H100
(docs/kernels.md, "Skinny linears"): weights with long rows (K >= 4096: 0.87-1.02x
cuBLAS's time, 0.96x over a Llama-3 8B layer) and LM heads (N >= 65536: 0.91-0.93x).
Shorter rows are as fast or faster in cuBLAS, and from ``MAX_ROWS`` rows up cuBLAS
runs every shape.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import kernel as _kernel, tl, triton

MAX_ROWS = 16        # one tile of rows
LONG_ROWS = 4096     # K from which the kernel streams a weight faster than cuBLAS
HEAD_COLS = 65536    # N from which it does at any K (LM heads)


@_kernel
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y, HAS_BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Addresses rebuilt from k0 each pass: 1.1-1.3x faster on the H100 than
        # advancing pointers, whose loop Triton pipelines worse.
        k = k0 + ks
        w_at = w_ptr + cols[:, None] * s_w + k[None, :]  # int32: the caller checks N * K
        x_at = x_ptr + rows[:, None] * s_x + k[None, :]
        if EVEN_K:
            w = tl.load(w_at, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_at, mask=row_ok[:, None], other=0.0)
        else:
            w = tl.load(w_at, mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(x_at, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def launch_config(k: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), as chosen by the H100 sweep (docs/kernels.md):
    K blocks of 1 KiB (512 halves), which 4 stages keep within shared memory."""
    return 32, min(1024 // element_size, max(16, triton.next_power_of_2(k))), 4, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` of at most MAX_ROWS rows (unit
    column strides); float32 accumulation, output in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bk, warps, stages = config or launch_config(k, x.element_size())
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays float32
        num_warps=warps, num_stages=stages)
    return y


class SkinnyLinear(nn.Linear):
    """nn.Linear that runs the skinny kernel for inputs of at most MAX_ROWS rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1:
            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def measured_on(device: torch.device) -> bool:
    """Hopper (the H100 and H200) is where the shape rule was measured. Other GPUs have
    other shared memory, caches and bandwidth, and no measurement says the kernel beats
    cuBLAS there: they keep cuBLAS for every linear."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def use_skinny_linears(model: nn.Module) -> None:
    """Make every plain half-precision nn.Linear of a CUDA model whose shape the
    kernel runs faster a SkinnyLinear (same parameters: only the class changes)."""
    for m in model.modules():
        w = m.weight if type(m) is nn.Linear else None
        if w is not None and w.dtype in (torch.float16, torch.bfloat16) and w.is_contiguous() \
                and w.numel() < 2 ** 31 and (w.shape[1] >= LONG_ROWS or w.shape[0] >= HEAD_COLS):
            m.__class__ = SkinnyLinear
