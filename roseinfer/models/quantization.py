"""Quantized models: which quantization method serves a model, and what every method
shares (the linears it may quantize, per-token FP8 activations).

A method is a plugin (core/hookspecs.py, ``roseinfer_register_quantization_methods``):
it reads its checkpoints' tensors into the float weights a family loads, and quantizes
a float model's linears at load. A checkpoint's own ``quantization_config`` picks the
method; ``quantization=NAME`` picks one for a float model.

Today every device runs a quantized model's linears on weights de-quantized to the
model's dtype: the values are exactly the quantized ones, so outputs are what the
format computes, but the weights take as many bytes as the float model's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def checkpoint_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    # A .gguf is converted to float safetensors once (models/loader.py); its config keeps
    # transformers' note of where the weights came from.
    return None if qc.get("quant_method") == "gguf" else qc


def method_for(hf_config, requested: str | None, plugins):
    """(name, method) that serves this model; (None, None) for a float model with none
    requested."""
    qc = checkpoint_config(hf_config)
    if qc is None:
        if requested is None:
            return None, None
        return requested, plugins.create("quantization", requested, None)
    regs = plugins.registrations("quantization")
    readers = [name for name, reg in sorted(regs.items()) if reg.factory.reads(qc)]
    if not readers:
        raise ConfigError(
            f"the checkpoint is quantized as {describe(qc)}, which no quantization method "
            f"reads. Supported: {'; '.join(f'{n}: {regs[n].factory.formats}' for n in sorted(regs))}")
    if requested is not None and requested not in readers:
        raise ConfigError(f"quantization={requested!r} does not read this checkpoint "
                          f"({describe(qc)}); {', '.join(readers)} does: leave quantization "
                          f"unset or name it")
    name = requested or readers[0]
    return name, plugins.create("quantization", name, qc)


def describe(qc: dict) -> str:
    """A checkpoint's quantization, as a user would name it in an error."""
    method = qc.get("quant_method", "?")
    if method == "compressed-tensors":
        return f"compressed-tensors {qc.get('format', '?')}"
    parts = [f"{k}={qc[k]}" for k in ("bits", "group_size", "version", "weight_block_size")
             if k in qc]
    return f"{method} ({', '.join(parts)})" if parts else method


def quantizable(model: nn.Module):
    """(name, linear) for each linear a method quantizes: all but the LM head's and the
    routers' of mixtures of experts (``router``: they pick the experts, and are small)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name.split(".")[-1] != "lm_head" \
                and not getattr(m, "router", False):
            yield name, m


def fp8_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (saturating) and back: what an FP8 tensor holds."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scale


def absmax_scale(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Per-row (along ``dim``) scales that map each row's largest magnitude to FP8_MAX."""
    return (x.abs().amax(dim=dim, keepdim=True).float() / FP8_MAX).clamp(min=1e-12).to(x.dtype)


class Fp8ActivationLinear(nn.Linear):
    """A linear whose input is rounded to FP8 per token (W8A8, dynamic activations): its
    weight holds FP8 values already, so the product is the one FP8 GEMMs compute, up
    to the accumulation order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        quantized = fp8_rows(rows.float(), absmax_scale(rows.float())).to(x.dtype)
        return F.linear(quantized.view(x.shape), self.weight, self.bias)
