"""4-bit linears on CUDA (W4A16): each weight is a level 0..15 with one scale per group of
128 input columns, ``w = (level - 8) * scale``, kept packed, half a byte a weight.

They run torch's own int4 kernel (``torch._weight_int4pack_mm``, tinygemm, bfloat16
activations), which streams the packed weight and de-quantizes it in registers. Three
Triton kernels written for this measured 1.3-6x slower than it on Llama-3-8B's linears
at 1 and 16 rows (docs/benchmarks.md, "INT4 linears"), and were dropped.
"""
from __future__ import annotations

import torch
from torch import nn

GROUP = 128        # inputs per scale
INNER_K_TILES = 8  # tinygemm's packing: fastest of 2, 4, 8 at one row on the H200


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per group: (levels 0..15 [N, K] int32, scales
    [N, K / group] float32 holding bfloat16 values, as the kernel keeps them), each
    group's largest magnitude at level 8 +- 7."""
    groups = w.float().view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-7).bfloat16().float()
    levels = (groups / scale).round().clamp(-8, 7) + 8
    return levels.view_as(w).to(torch.int32), scale.squeeze(-1)


def dequantize(levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = levels.shape[1] // scale.shape[1]
    return (levels.float() - 8) * scale.float().repeat_interleave(group, 1)


def runs_here(device: torch.device, dtype: torch.dtype) -> bool:
    """tinygemm: bfloat16 on CUDA GPUs of compute capability 8.0 (Ampere) and up."""
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(device) >= (8, 0) and \
        hasattr(torch, "_weight_int4pack_mm")


def pack(levels: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tinygemm's packed weight, its [K / 128, N, 2] bfloat16 (scale, zero) table) of
    levels [N, K] and scales [N, K / 128]. tinygemm computes (level - 8) * scale + zero:
    zero is 0 here, the levels being symmetric."""
    two_a_byte = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(two_a_byte, INNER_K_TILES)
    scale = scale.to(torch.bfloat16)
    table = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1).contiguous()
    return packed, table


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight is ``qweight`` (tinygemm's packing) and ``scales``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch._weight_int4pack_mm(rows.contiguous(), self.qweight, GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def to_int4(linear: nn.Linear) -> None:
    """Make ``linear`` (bfloat16 weights on CUDA, inputs a multiple of 128) an Int4Linear
    in place: its weight rounded per group of 128 inputs (``quantize``), the float copy
    freed."""
    qweight, scales = pack(*quantize(linear.weight.detach(), GROUP))
    del linear.weight
    # parameters (not buffers): what reads a model's weights (the bench's bytes floor,
    # a state dict) finds them
    linear.qweight = nn.Parameter(qweight, requires_grad=False)
    linear.scales = nn.Parameter(scales, requires_grad=False)
    linear.__class__ = Int4Linear
