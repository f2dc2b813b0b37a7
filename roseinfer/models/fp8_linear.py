"""FP8 linears on CUDA (W8A8, dynamic): e4m3 weights with one scale per output channel
stay FP8 in GPU memory, and each input row is rounded to e4m3 with a scale of its own
(its largest magnitude maps to 448), as vLLM's ``--quantization fp8`` computes.

Decode rows (at most MAX_ROWS) go through one Triton kernel that streams each weight
once, at one byte a value: each program finds its rows' scales in a first pass over
the (small, cached) input, then rounds the input tiles as it multiplies them with the
weight tiles on the tensor cores. More rows go to ``torch._scaled_mm`` (FP8 tensor-core
GEMM with row-wise scales). On the CPU the model keeps the de-quantized values
(plugins/quantization/fp8.py): the same products, up to the order of the sums.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale

MAX_ROWS = 16  # one tile of rows


@_kernel
def _fp8_skinny_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    amax = tl.zeros([16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * s_x + k[None, :],
                    mask=row_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(amax / 448.0, 1e-12)  # absmax_scale's
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = (k < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * s_x + k[None, :], mask=row_ok[:, None] & k_ok,
                    other=0.0).to(tl.float32)
        x = tl.clamp(x / scale[:, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.float16)
        w = tl.load(w_ptr + cols[:, None] * s_w + k[None, :], mask=col_ok[:, None] & k_ok,
                    other=0.0).to(tl.float16)  # e4m3 values are exact in float16
        acc = tl.dot(x, tl.trans(w), acc)
    acc = acc * scale[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product of a 2-D ``x`` of at most MAX_ROWS rows (unit column strides)
    with e4m3 ``weight`` [N, K] and its float32 per-channel ``weight_scale`` [N]."""
    m, k = x.shape
    n = weight.shape[0]
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device, m)
    _fp8_skinny_kernel[(triton.cdiv(n, 32),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=32,
        BLOCK_K=block_k, PDL=pdl, num_warps=4, num_stages=4 if k >= 4096 else 3,
        launch_pdl=pdl)
    return y


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product for any number of rows: ``torch._scaled_mm`` (row-wise scales
    give bfloat16 out), else through the de-quantized weight (a slow path, for other
    dtypes)."""
    scale = absmax_scale(x.float())
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if x.dtype == torch.bfloat16:
        y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1),
                             out_dtype=x.dtype)
    else:
        y = F.linear((q.float() * scale).to(x.dtype),
                     (weight.float() * weight_scale[:, None]).to(x.dtype))
    return y if bias is None else y + bias


def runs_here(device: torch.device) -> bool:
    """FP8 tensor-core conversions and GEMMs: compute capability 8.9 (Ada) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose weight is e4m3 with ``weight_scale`` per output channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS and rows.stride(1) == 1:
            y = fp8_skinny_linear(rows, self.weight, self.weight_scale, self.bias)
        else:
            y = fp8_gemm(rows.contiguous(), self.weight, self.weight_scale, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def to_fp8(linear: nn.Linear) -> None:
    """Make ``linear`` (float weights, on CUDA) an Fp8Linear in place: its weight rounded
    to e4m3 per output channel, the float copy freed."""
    w = linear.weight.detach().float()
    scale = absmax_scale(w).view(-1)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.register_buffer("weight_scale", scale)
    linear.__class__ = Fp8Linear
