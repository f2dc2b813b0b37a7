"""Lower-precision linear weights for a float32 model on the CPU (``cpu_weight_dtype``).

At batch 1 a step reads every weight once, so its time follows the weights' bytes
(docs/benchmarks.md). Both forms take bfloat16 inputs, sum in float32 and hand
back float32; the residual stream, the norms and attention stay float32:

- ``bfloat16``: half the bytes, in oneDNN's packed layout (AMX or AVX512-BF16
  where the CPU has them), the LM head too, as a BF16 GGUF file holds it: on the
  default model that took decode from 0.68-0.71x llama.cpp's BF16 file to 0.79-1.00x,
  and 4 of 16 greedy continuations leave float32's, each where float32's first two
  choices are 0.07-0.14 nats apart (docs/benchmarks.md).
- ``int8``: a quarter, one float32 scale per output row, run by ATen's
  weight-only int8 kernel ``_weight_int8pack_mm``; the LM head stays float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.errors import ConfigError
from roseinfer.layers.cpu_linear import frozen
from roseinfer.layers.embedding import LogitsHead


class RoundedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weight_dtype: str):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Parameters, as CpuLinear's: a compiled step (core/cpu_step.py) finds them by name
        self.bias = frozen(None if linear.bias is None else linear.bias.detach())
        # The int8 kernel reads inputs 16 at a time and returns garbage, or crashes, on a
        # width that is not a multiple of 16: such weights and inputs get zero columns.
        self.pad = (-self.in_features) % 16 if weight_dtype == "int8" else 0
        if weight_dtype == "int8":
            scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(weight.dtype).tiny) / 127
            weight = F.pad(weight / scale[:, None], (0, self.pad))
            self.weight = frozen(weight.round_().to(torch.int8))
            # The kernel's scales are bfloat16, which would round each row's by up to
            # 0.4%: it runs with ones, and the float32 scales multiply its output.
            self.scale = frozen(scale)
            self.ones = frozen(torch.ones(self.out_features, dtype=torch.bfloat16))
        else:
            self.weight = frozen(torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), 16))
            self.scale = None

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.pad:
            flat = F.pad(flat, (0, self.pad))
        if self.scale is None:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, None, "none", [], "")
            out = out.float()
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.ones).float()
            out.mul_(self.scale)
        if self.bias is not None:
            out += self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if gelu is None else F.gelu(out, approximate=gelu)


def round_linears(model: nn.Module, weight_dtype: str) -> None:
    """Swap every nn.Linear for a RoundedLinear, but int8's LM head."""
    if weight_dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ConfigError("cpu_weight_dtype bfloat16 needs oneDNN's bfloat16 kernels, which "
                          "this CPU lacks (they need AVX-512): use int8 or float32")
    for parent in list(model.modules()):
        if isinstance(parent, LogitsHead) and weight_dtype == "int8":
            continue
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, RoundedLinear(child, weight_dtype))
