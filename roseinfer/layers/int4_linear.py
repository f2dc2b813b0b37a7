"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with a scale and a shift
per group of input columns, ``w = level * scale + shift`` (``shift = -zero * scale``:
symmetric levels have zero 8, AWQ's their own), kept packed, half a byte a weight.

Up to ``MAX_ROWS`` rows (decode, verify steps) GemLite's Triton kernels multiply the
packed words: its GEMV for one row, its split-K GEMM for more. Its layout is GPTQ's,
int32 words ``[K / 8, N]``, input 8r + j in nibble j of word r, with scales and shifts
``[K / group, N]``. Beyond, the weight is de-quantized into a bf16 buffer (``unpack``,
at memory speed) and cuBLAS multiplies it: 1.4-1.5x the bf16 linear's time at 512 rows,
1.04-1.11x at 2,048 (the de-quantization's share shrinks as the rows grow). docs/kernels.md ("INT4 linears") has the candidates measured per shape and
row count (torch's tinygemm, GemLite's kernels, this module's own tensor-core kernel),
and why these were chosen.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import functools
import importlib.util
import os

import torch
from torch import nn

from roseinfer.core.triton_support import kernel, tl, triton

WORD = 8           # levels per int32 word
MAX_ROWS = 64      # GemLite's kernels; cuBLAS over the de-quantized weight beyond


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per group: (levels 0..15 [N, K] int32, scales
    [N, K / group] float32 holding bfloat16 values, as the kernel keeps them), each
    group's largest magnitude at level 8 +- 7."""
    groups = w.float().view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-7).bfloat16().float()
    levels = (groups / scale).round().clamp(-8, 7) + 8
    return levels.view_as(w).to(torch.int32), scale.squeeze(-1)


def dequantize(levels: torch.Tensor, scale: torch.Tensor,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    """(levels - zeros) * scale, float32 [N, K]; zeros [N, K / group] (default 8)."""
    group = levels.shape[1] // scale.shape[1]
    zeros = 8 if zeros is None else zeros.float().repeat_interleave(group, 1)
    return (levels.float() - zeros) * scale.float().repeat_interleave(group, 1)


def runs_here(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernels: bfloat16 on CUDA GPUs of compute capability 8.0 (Ampere) and up,
    with GemLite installed (``pip install roseinfer[gpu]``)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(device) >= (8, 0) and triton is not None and \
        importlib.util.find_spec("gemlite") is not None


def packs(k: int, group: int) -> bool:
    """Whether a linear of ``k`` inputs in groups of ``group`` packs (whole tiles of 128
    inputs, as the kernels were measured on)."""
    return k % 128 == 0 and k % group == 0 and group % 16 == 0


@kernel
def _unpack_kernel(q_ptr, s_ptr, z_ptr, out_ptr, rows, N, GROUP_WORDS: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_R words by BLOCK_N columns of the weight, transposed: out [K, N]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < rows)[:, None] & (cols < N)[None, :]
    words = tl.load(q_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0)
    meta = (r // GROUP_WORDS)[:, None] * N + cols[None, :]
    scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(z_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        value = ((words >> (4 * j)) & 15).to(tl.float32) * scale + shift
        tl.store(out_ptr + (r * 8 + j)[:, None] * N + cols[None, :],
                 value.to(out_ptr.dtype.element_ty), mask=mask)


def unpack(qweight: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's transpose [K, N], ``level * scale + shift`` in the scales' dtype
    (into ``out`` where given)."""
    rows, n = qweight.shape
    if out is None:
        out = torch.empty(rows * WORD, n, dtype=scales.dtype, device=qweight.device)
    _unpack_kernel[(triton.cdiv(rows, 16), triton.cdiv(n, 128))](
        qweight, scales, shifts, out, rows, n, GROUP_WORDS=rows // scales.shape[0],
        BLOCK_R=16, BLOCK_N=128, num_warps=4)
    return out


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is packed in ``kernel``, a GemLite linear (module doc):
    its ``W_q``, ``scales`` and ``zeros`` (the shifts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        g = self.kernel
        if rows.shape[0] <= MAX_ROWS:
            kind = "GEMV_REVSPLITK" if rows.shape[0] == 1 else "GEMM_SPLITK"
            y = g.forward_manual(rows.contiguous(), kind)
        else:
            y = rows @ unpack(g.W_q, g.scales, g.zeros, _buffer(g))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


_BUFFERS: dict = {}


@functools.cache
def _gemlite():
    """GemLite, imported where it runs (its import touches CUDA), with launch configs
    tuned on the H100 for the H200 too (the same 132 SMs; it picks by the GPU's name,
    and tunes at first use what it has none for)."""
    import gemlite
    from gemlite.core import TORCH_TO_DTYPE, GemLiteLinearTriton, get_default_cache_config, \
        set_native_atomic_bfp16
    # Split-K sums added in float32, rounded once: added atomically in bf16 (its default
    # on Hopper) they were 2 % off the float64 product at one row of 4096 x 4096, ~7x
    # a bf16 linear's rounding
    set_native_atomic_bfp16(False)
    if get_default_cache_config() is None and torch.cuda.get_device_capability() == (9, 0):
        GemLiteLinearTriton.load_config(os.path.join(os.path.dirname(gemlite.__file__),
                                                     "configs", "h100.json"))
    return TORCH_TO_DTYPE, GemLiteLinearTriton


def _buffer(g) -> torch.Tensor:
    """One de-quantization buffer per device and dtype, as large as the largest weight
    asked for: linears run one at a time."""
    size = g.W_q.numel() * WORD
    key = (g.W_q.device, g.scales.dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < size:
        buf = _BUFFERS[key] = torch.empty(size, dtype=g.scales.dtype, device=g.W_q.device)
    return buf[:size].view(g.W_q.shape[0] * WORD, g.W_q.shape[1])


def to_int4(linear: nn.Linear, levels: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None) -> None:
    """Make ``linear`` (on CUDA) an Int4Linear in place, from levels [N, K], scales and
    zeros [N, K / group] (zeros default 8: symmetric), the float weight freed."""
    n, k = levels.shape
    dtype = linear.weight.dtype
    if scales.shape[1] == 1:  # per channel: the same scale for every group of 128
        scales = scales.expand(n, k // 128)
        zeros = None if zeros is None else zeros.expand(n, k // 128)
    zeros = torch.full_like(scales, 8.0) if zeros is None else zeros
    g = gemlite_linear(levels, scales.to(dtype), zeros.to(dtype))
    del linear.weight
    linear.kernel = g.requires_grad_(False)
    linear.__class__ = Int4Linear
    _buffer(g)  # now, not first inside a CUDA graph's capture


def gemlite_linear(levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """GemLite's linear of these levels, scales and zeros ([N, K / group], the dtype of
    the activations): its ``W_q``, ``scales`` and ``zeros`` as the module doc says."""
    TORCH_TO_DTYPE, GemLiteLinearTriton = _gemlite()
    n, k = levels.shape
    dtype = TORCH_TO_DTYPE[scales.dtype]
    g = GemLiteLinearTriton(4, group_size=k // scales.shape[1], in_features=k,
                            out_features=n, input_dtype=dtype, output_dtype=dtype)
    # fma_mode: the kernels compute level * scale + zeros, zeros = -zero * scale (rounded
    # to the dtype, as the scales are)
    return g.pack(levels.to(torch.uint8), scales, zeros, fma_mode=True)
