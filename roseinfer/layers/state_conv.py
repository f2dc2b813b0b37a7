"""The short causal convolution of recurrent layers (Mamba2's over x, B and C; gated
DeltaNet's over q, k and v), each sequence's last ``kernel - 1`` inputs kept in its
state row (core/recurrent.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv(state: torch.Tensor, x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """A depthwise causal convolution of one sequence's step tokens ``x`` [T, C] after
    its stored inputs ``state`` [C, kernel - 1], which move on in place: [T, C], before
    the activation."""
    window = torch.cat([state, x.t().to(state.dtype)], dim=1)  # [C, kernel - 1 + T]
    state.copy_(window[:, window.shape[1] - state.shape[1]:])
    out = F.conv1d(window.unsqueeze(0).to(conv.weight.dtype), conv.weight, conv.bias,
                   groups=window.shape[0])
    return out[0].t().to(x.dtype)
