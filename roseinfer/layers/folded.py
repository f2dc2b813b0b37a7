"""The elementwise ops beside a decode step's linears, folded into the skinny kernel's
launch where that kernel runs (layers/skinny_linear.py): at batch 1 each of them was a
launch of its own, a few microseconds on the critical path for a few kilobytes of work.
They run only with ``ROSEINFER_FOLDS=1`` (``folds_on``) until a step shows they pay.

- ``gated_down``: the MLP's act(gate) * up is computed as its down projection reads it.
- ``linear_plus``: the residual add after o_proj and down_proj happens in their
  epilogue, which also leaves each row's sum of squares (``SummedRows``).
- ``norm_of``: the RMSNorm after that add becomes a ``PendingNorm`` that the next
  linear (qkv, gate_up) applies as it reads its rows; where that linear runs cuBLAS, the
  norm runs as before, without the add.

A dense Llama layer at batch 1 then launches qkv, RoPE, the KV append, attention, its
merge, o, gate_up and down: 8 kernels where it launched 11. Each fold rounds where the
unfused op stores its result, so the products see the same values; only the norm's sum
of squares is added in another order (partials a program, then in a fixed order).
"""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.core.triton_support import folds_on
from roseinfer.layers.fused import add_rms_norm, gelu_tanh_and_mul, silu_and_mul
from roseinfer.layers.skinny_linear import PendingNorm, SkinnyLinear, SummedRows, \
    skinny_linear

SILU, GELU_TANH = 1, 2  # skinny_linear's ``gated``


def folds_into(linear: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether ``linear`` runs the skinny kernel on ``x`` and an op beside its product
    joins its launch: a plain SkinnyLinear (not wrapped: LoRA's own launch reads the rows
    as they are), one rank (the sum over ranks comes before any add), and one row: there a
    launch's fixed cost is most of the op's, while over the tile's 16 rows the ops cost
    more than their launches (down_proj gated at 16 rows: 6x its time, docs/kernels.md)."""
    return (folds_on() and type(linear) is SkinnyLinear and x.dim() == 2 and x.stride(1) == 1
            and x.shape[0] == 1 and tp.group().size == 1)


def gated_down(down: nn.Module, gate_up: torch.Tensor, gelu: bool = False,
               residual: torch.Tensor | None = None, fp8: bool = False
               ) -> torch.Tensor | SummedRows:
    """``down(act(gate) * up)`` (SiLU, or gelu-tanh) in one launch where ``down`` takes it;
    with ``residual``, plus the residual in that launch too where it can
    (``linear_plus``). ``fp8``: the activations rounded to e4m3 for an FP8 ``down``."""
    if folds_into(down, gate_up):
        return skinny_linear(gate_up, down.weight, down.bias, gated=GELU_TANH if gelu else SILU,
                             residual=_addable(residual, down))
    gated = gelu_tanh_and_mul(gate_up) if gelu else silu_and_mul(gate_up, fp8=fp8)
    return linear_plus(down, gated, residual)


def linear_plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                ) -> torch.Tensor | SummedRows:
    """``linear(x) + residual`` as SummedRows where the add joins the linear's launch;
    else ``linear(x)``, and the norm after it adds the residual as before."""
    if residual is not None and isinstance(x, torch.Tensor) and folds_into(linear, x) \
            and _addable(residual, linear) is not None:
        return skinny_linear(x, linear.weight, linear.bias, residual=residual)
    return linear(x)


def _addable(residual: torch.Tensor | None, linear: nn.Module) -> torch.Tensor | None:
    """The residual where the epilogue can add it: rows of the linear's output width with
    unit column stride."""
    if residual is None or residual.dim() != 2 or residual.stride(1) != 1 or \
            residual.shape[1] != linear.weight.shape[0]:
        return None
    return residual


def norm_of(summed: SummedRows, weight: torch.Tensor, eps: float, into: nn.Module | None,
            fp8: bool = False):
    """(the RMSNorm of ``summed.rows`` for ``into``, the residual stream): a PendingNorm
    where ``into`` applies it as it reads, else the normed rows (one launch, no add)."""
    if folds_into(into, summed.rows):
        return PendingNorm(summed, weight, eps), summed.rows
    return add_rms_norm(summed.rows, None, weight, eps, fp8=fp8)[0], summed.rows

