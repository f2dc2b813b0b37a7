"""A vision tower's patch embedding as one matrix product. Qwen-VL towers cut an image into
patches (channels x frames x 14 x 14 values each) and embed each with a Conv3d whose
kernel is its stride: a linear map of the patch's values, which torch then runs as a 3-D
convolution (oneDNN's on the CPU: a third of the tiny test tower's call; cuDNN's on a
GPU). ``as_linear`` gives transformers' patch-embedding module a forward that multiplies
the flattened patches by the convolution's weight instead: the same products, summed in
another order."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def as_linear(patch_embed: torch.nn.Module) -> None:
    """``patch_embed`` (a module with a kernel-is-stride ``proj`` Conv3d) runs as a linear."""
    conv = patch_embed.proj
    assert tuple(conv.kernel_size) == tuple(conv.stride) and conv.padding in (0, (0, 0, 0))
    patch_embed.forward = types.MethodType(_linear_forward, patch_embed)


def _linear_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight  # [embed, channels, frames, height, width]
    flat = hidden_states.to(weight.dtype).reshape(-1, weight[0].numel())
    return F.linear(flat, weight.flatten(1), self.proj.bias)
