"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with a scale and a shift
per group of input columns, ``w = level * scale + shift`` (``shift = -zero * scale``:
symmetric levels have zero 8, AWQ's its own), kept packed, half a byte a weight.

The packing is this module's own, made for the tensor cores: int32 words ``[K / 8,
N]``, where tile t (inputs 128t..128t+127) of output n is words 16t..16t+15, and nibble
j of word 16t + r holds input 128t + 16j + r. So nibble j of a tile's 16 words is 16
consecutive inputs: one shift and mask turn a [16, BLOCK_N] tile of words into the
operand of a tensor-core product with x's matching [rows, 16] slice, with no shuffle
in registers. Groups of 32 and more scale whole slices; groups of 128 and more scale
the tile's sum once.

Up to ``MAX_ROWS`` rows (decode, verify steps) one kernel streams the words once
(``w4a16``); from there, the weight is de-quantized into a bf16 buffer (``unpack``,
at memory speed) and cuBLAS multiplies it, which is within ~10 % of the bf16 linear
from 512 rows up (docs/kernels.md, "INT4 linears").
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel, tl, triton, \
    wait_for_inputs

TILE = 128         # inputs per tile of 16 words
WORD = 8           # levels per int32 word
MAX_ROWS = 64      # the kernel's rows; cuBLAS over the de-quantized weight beyond


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
    """The kernels: bfloat16 on CUDA GPUs of compute capability 8.0 (Ampere) and up."""
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(device) >= (8, 0) and triton is not None


def packs(k: int, group: int) -> bool:
    """Whether a linear of ``k`` inputs in groups of ``group`` packs: whole tiles, and
    groups that scale whole 16-input slices."""
    return k % TILE == 0 and group % 16 == 0 and (group % TILE == 0 or TILE % group == 0)


def pack(levels: torch.Tensor) -> torch.Tensor:
    """Levels [N, K] (0..15) -> the int32 words [K / 8, N] the kernels read."""
    n, k = levels.shape
    # [tile, nibble j, word r, n] -> [tile, r, j, n]: word r's nibble j is input 16j + r
    tiles = levels.t().reshape(k // TILE, WORD, TILE // WORD, n).transpose(1, 2)
    pairs = tiles.reshape(k // WORD, WORD // 2, 2, n).to(torch.uint8)
    byte = pairs[:, :, 0] | pairs[:, :, 1] << 4                   # [K / 8, 4, N]
    return byte.permute(0, 2, 1).contiguous().view(torch.int32).squeeze(-1)


@kernel
def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, s_x, s_y,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr):
    """y = x @ w.T (+ b), w packed (module doc). Each program owns BLOCK_M rows and
    BLOCK_N columns and walks the whole of K, TILES tiles of 128 inputs a pass."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < N, rows < M
    r16 = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, TILES * 128):
        for t in tl.static_range(TILES):
            kt = k0 + t * 128
            words = tl.load(q_ptr + (kt // 8 + r16)[:, None] * N + cols[None, :],
                            mask=col_ok[None, :], other=0)
            tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_ptr + rows[:, None] * s_x + (kt + 16 * j + r16)[None, :],
                            mask=row_ok[:, None], other=0.0)
                levels = ((words >> (4 * j)) & 15).to(x.dtype)
                if GROUP >= 128:  # one scale for the tile: summed unscaled
                    tile = tl.dot(x, levels, tile)
                    xsum += tl.sum(x.to(tl.float32), 1)
                else:             # the slice's own group
                    at = (kt + 16 * j) // GROUP * N + cols
                    scale = tl.load(s_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                    shift = tl.load(z_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                    acc += tl.dot(x, levels) * scale[None, :] + \
                        tl.sum(x.to(tl.float32), 1)[:, None] * shift[None, :]
            if GROUP >= 128:
                at = kt // GROUP * N + cols
                scale = tl.load(s_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                shift = tl.load(z_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                acc += tile * scale[None, :] + xsum[:, None] * shift[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def launch_config(m: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, TILES, warps, stages)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64, 32, 2, 4, 3


def w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
          shifts: torch.Tensor, bias: torch.Tensor | None = None,
          config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight's transpose (+ bias): [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    bm, bn, tiles, warps, stages = config or launch_config(m, k)
    if k % (tiles * TILE):
        tiles = 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device, m)
    _w4a16_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, qweight, scales, shifts, bias if bias is not None else scales, y, m, n, k,
        x.stride(0), y.stride(0), GROUP=k // scales.shape[0], HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, TILES=tiles, PDL=pdl, num_warps=warps, num_stages=stages,
        launch_pdl=pdl)
    return y


@kernel
def _unpack_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """One tile of 128 inputs by BLOCK_N columns of the weight, transposed: out [K, N]."""
    kt = tl.program_id(0) * 128
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    r16 = tl.arange(0, 16)
    words = tl.load(q_ptr + (kt // 8 + r16)[:, None] * N + cols[None, :],
                    mask=col_ok[None, :], other=0)
    for j in tl.static_range(8):
        at = (kt + 16 * j) // GROUP * N + cols
        scale = tl.load(s_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
        shift = tl.load(z_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
        value = ((words >> (4 * j)) & 15).to(tl.float32) * scale[None, :] + shift[None, :]
        tl.store(out_ptr + (kt + 16 * j + r16)[:, None] * N + cols[None, :],
                 value.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])


def unpack(qweight: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's transpose [K, N], ``level * scale + shift`` in the scales' dtype
    (into ``out`` where given)."""
    k, n = qweight.shape[0] * WORD, qweight.shape[1]
    if out is None:
        out = torch.empty(k, n, dtype=scales.dtype, device=qweight.device)
    _unpack_kernel[(k // TILE, triton.cdiv(n, 128))](
        qweight, scales, shifts, out, n, GROUP=k // scales.shape[0], BLOCK_N=128,
        num_warps=4)
    return out


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is ``qweight`` (packed levels, module doc), ``scales``
    and ``shifts`` ([K / group, N])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS:
            y = w4a16(rows.contiguous(), self.qweight, self.scales, self.shifts, self.bias)
        else:
            y = rows @ unpack(self.qweight, self.scales, self.shifts, _buffer(self))
            if self.bias is not None:
                y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


_BUFFERS: dict = {}


def _buffer(linear: Int4Linear) -> torch.Tensor:
    """One de-quantization buffer per device and dtype, as large as the largest weight
    asked for: linears run one at a time."""
    q = linear.qweight
    size = q.numel() * WORD
    key = (q.device, linear.scales.dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < size:
        buf = _BUFFERS[key] = torch.empty(size, dtype=linear.scales.dtype, device=q.device)
    return buf[:size].view(q.shape[0] * WORD, q.shape[1])


def to_int4(linear: nn.Linear, levels: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None) -> None:
    """Make ``linear`` an Int4Linear in place, from levels [N, K], scales and zeros
    [N, K / group] (zeros default 8: symmetric), the float weight freed."""
    dtype = linear.weight.dtype if hasattr(linear, "weight") else scales.dtype
    zeros = torch.full_like(scales, 8.0) if zeros is None else zeros
    if hasattr(linear, "weight"):
        del linear.weight
    # parameters (not buffers): what reads a model's weights (the bench's bytes floor,
    # a state dict) finds them
    linear.qweight = nn.Parameter(pack(levels), requires_grad=False)
    linear.scales = nn.Parameter(scales.t().to(dtype).contiguous(), requires_grad=False)
    linear.shifts = nn.Parameter((-zeros.float() * scales.float()).t().to(dtype).contiguous(),
                                 requires_grad=False)
    linear.__class__ = Int4Linear
    _buffer(linear)  # now, not first inside a CUDA graph's capture
