"""The short causal convolution of recurrent layers (Mamba2's over x, B and C; gated
DeltaNet's over q, k and v), each sequence's last ``kernel - 1`` inputs kept in its
state row (core/recurrent.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv(state: torch.Tensor, x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """A depthwise causal convolution of B sequences' step tokens ``x`` [B, T, C] after
    their stored inputs ``state`` [B, C, kernel - 1], which move on in place: [B, T, C],
    before the activation."""
    window = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=2)
    state.copy_(window[..., window.shape[2] - state.shape[2]:])
    out = F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=window.shape[1])
    return out.transpose(1, 2).to(x.dtype)
