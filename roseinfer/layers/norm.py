"""RMSNorm, with the residual add folded in."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.layers.fused import add_rms_norm


class RMSNorm(nn.Module):
    unit_offset = False  # Gemma's scale by 1 + weight (GemmaRMSNorm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                summed: bool = True, fp8: bool = False):
        """(norm(x + residual), x + residual) in one kernel on CUDA. ``summed=False``:
        ``x`` is this rank's part of a row-parallel layer's output, summed over the
        ranks first: in the same kernel where the one-shot all-reduce takes it. ``fp8``
        (for a linear that takes them): the normed rows as QuantizedRows where this kernel
        makes them, else a tensor (the one-shot all-reduce's), which the linear rounds."""
        if not summed and tp.group().size > 1:  # a group of one has nothing to sum
            fused = tp.all_reduce_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = tp.all_reduce(x)
        return add_rms_norm(x, residual, self.weight, self.eps, fp8=fp8)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by 1 + weight (its weights are offsets from one), in
    float32, rounded once. ``first``: a norm ``x`` goes through before the add (a block's
    post-norm), in the same kernel."""
    unit_offset = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                first: "GemmaRMSNorm | None" = None):
        return add_rms_norm(x, residual, self.weight, self.eps, unit_offset=True,
                            x_weight=None if first is None else first.weight)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a width split across the tensor-parallel ranks (OLMoE's q and k norms
    span all heads, which the ranks share out): the mean square is summed over the ranks
    before it scales this rank's part."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if tp.group().size == 1:
            return super().forward(x, residual)
        assert residual is None, "a sharded norm has no residual stream"
        square = tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        scale = torch.rsqrt(square / (x.shape[-1] * tp.group().size) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight, x
