"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with a scale and a shift
per group of input columns, ``w = level * scale + shift`` (``shift = -zero * scale``:
symmetric levels have zero 8, AWQ's their own), kept packed, half a byte a weight.

Up to ``MAX_ROWS`` rows (decode, verify steps) the project's tensor-core kernel
(layers/int4_mma.py, built with nvcc at first use) multiplies the packed words, in its
own layout: panels of 32 columns, the nibbles of a word in its order. Where it cannot
run (no nvcc, widths not in whole panels), GemLite's Triton kernels do, over GPTQ's
layout (int32 words ``[K / 8, N]``, input 8r + j in nibble j of word r, scales and
shifts ``[K / group, N]``): its GEMV for one row, its split-K GEMM for more. Beyond
``MAX_ROWS`` the weight is de-quantized from either layout into a bf16 buffer
(``unpack``, at memory speed) and cuBLAS multiplies it: 1.4-1.5x the bf16 linear's time
at 512 rows, 1.04-1.11x at 2,048. docs/kernels.md ("INT4 linears") has the candidates
measured per shape and row count, and why these were chosen.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import functools
import importlib.util
import logging
import os

import torch
from torch import nn

from roseinfer.core.triton_support import kernel, tl, triton
from roseinfer.layers import int4_mma

log = logging.getLogger(__name__)

WORD = 8           # levels per int32 word
MAX_ROWS = 64      # the packed kernels; cuBLAS over the de-quantized weight beyond


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
                   PANELS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_R words by BLOCK_N columns of the weight, transposed: out [K, N]. PANELS:
    int4_mma's layout (panels of 32 columns, a word's nibbles in its SIGMA order), else
    GPTQ's."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < rows)[:, None] & (cols < N)[None, :]
    groups = rows // GROUP_WORDS
    if PANELS:
        panel = (cols // 32 * 32)[None, :]
        at = panel * rows + r[:, None] * 32 + (cols % 32)[None, :]
        meta = panel * groups + (r // GROUP_WORDS)[:, None] * 32 + (cols % 32)[None, :]
    else:
        at = r[:, None] * N + cols[None, :]
        meta = (r // GROUP_WORDS)[:, None] * N + cols[None, :]
    words = tl.load(q_ptr + at, mask=mask, other=0)
    scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(z_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        value = ((words >> (4 * j)) & 15).to(tl.float32) * scale + shift
        # the input nibble j holds: int4_mma.SIGMA[j] = 2 (j % 4) + j // 4, or j
        row = r * 8 + (2 * (j % 4) + j // 4 if PANELS else j)
        tl.store(out_ptr + row[:, None] * N + cols[None, :],
                 value.to(out_ptr.dtype.element_ty), mask=mask)


def unpack(qweight: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's transpose [K, N], ``level * scale + shift`` in the scales' dtype
    (into ``out`` where given), from GPTQ's layout ([K / 8, N] words) or int4_mma's
    ([N / 32, K / 8, 32])."""
    panels = qweight.dim() == 3
    rows, n = (qweight.shape[1], qweight.shape[0] * 32) if panels else qweight.shape
    groups = scales.shape[1] if panels else scales.shape[0]
    if out is None:
        out = torch.empty(rows * WORD, n, dtype=scales.dtype, device=qweight.device)
    _unpack_kernel[(triton.cdiv(rows, 16), triton.cdiv(n, 128))](
        qweight, scales, shifts, out, rows, n, GROUP_WORDS=rows // groups, PANELS=panels,
        BLOCK_R=16, BLOCK_N=128, num_warps=4)
    return out


class PackedInt4(nn.Module):
    """The weight in int4_mma's layout: its ``W_q`` words, ``scales`` and ``zeros`` (the
    shifts), named as GemLite's are."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor):
        super().__init__()
        self.register_buffer("W_q", int4_mma.pack(levels))
        self.register_buffer("scales", int4_mma.panels(scales.t()))
        self.register_buffer("zeros", int4_mma.panels(shifts.t()))

    def small(self, rows: torch.Tensor) -> torch.Tensor:
        return int4_mma.mm(rows, self.W_q, self.scales, self.zeros)

    def step_weights(self) -> list[torch.Tensor]:
        """What a step reads (bench/floor.py counts parameters, and these are buffers)."""
        return [self.W_q, self.scales, self.zeros]


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is packed in ``kernel``: a PackedInt4, or a GemLite
    linear (module doc); either's ``W_q``, ``scales`` and ``zeros`` (the shifts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        g = self.kernel
        if rows.shape[0] <= MAX_ROWS and isinstance(g, PackedInt4):
            y = g.small(rows)
        elif rows.shape[0] <= MAX_ROWS:
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
    k = (g.W_q.shape[1] if g.W_q.dim() == 3 else g.W_q.shape[0]) * WORD
    return buf[:size].view(k, size // k)


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
    g = _own(levels, scales.to(dtype), zeros)
    if g is None:
        g = gemlite_linear(levels, scales.to(dtype), zeros.to(dtype))
    del linear.weight
    linear.kernel = g.requires_grad_(False)
    linear.__class__ = Int4Linear
    _buffer(g)  # now, not first inside a CUDA graph's capture


def _own(levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """A PackedInt4 of the weight, tuned, where int4_mma runs it; else None."""
    n, k = levels.shape
    if scales.dtype != torch.bfloat16 or \
            not int4_mma.runs(levels.device, n, k, k // scales.shape[1]):
        return None
    try:
        int4_mma.ops(torch.cuda.get_device_capability(levels.device))
    except RuntimeError as e:
        log.warning("4-bit linears run GemLite's kernels: %s", e)
        return None
    # the shifts rounded to the scales' dtype, as GemLite keeps them
    g = PackedInt4(levels, scales, (-zeros.float() * scales.float()).to(scales.dtype))
    int4_mma.tune(g.W_q, g.scales, g.zeros)
    return g


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
