"""RMSNorm, with the residual add folded in."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.layers.fused import add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(norm(x + residual), x + residual) in one kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps)
