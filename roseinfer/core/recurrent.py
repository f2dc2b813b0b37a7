"""The recurrent-state cache: beside the paged K/V of attention layers, each sequence's
fixed-size state in every layer that keeps one (Mamba2's convolution inputs and SSM
state, layers/mamba2.py), a row a sequence.

A state row is the sequence's block-table row (core/step_inputs.py, ``TableRows``): it is
given with the row when the sequence is admitted and goes back with it, preempted or
finished, so the cache needs no bookkeeping of its own. A layer finds its sequences' rows
in the step context (``StepContext.seq_rows``) and starts from zeros where a sequence's
step starts at position 0.

What a state cannot do yet, the engine turns off for such a model (``decided``): a
prefix-cache hit, or a sample sharing its first sample's prompt, would start a sequence
past position 0 with no state for it, so the prefix cache and prompt sharing are off;
drafts that are rejected would leave their tokens in the state, so speculative decoding
is refused; the layers run a sequence at a time in plain torch, so CUDA graphs and the
compiled CPU step are off (issue 71: snapshots at block boundaries, and kernels).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from roseinfer.core.attention import get_context
from roseinfer.core.errors import ConfigError

log = logging.getLogger(__name__)


def layers(model: torch.nn.Module) -> list:
    """The modules that keep a state per sequence (``state_shapes``)."""
    return [m for m in model.modules() if hasattr(m, "state_shapes")]


def decided(cfg, model: torch.nn.Module):
    """``cfg`` with what a recurrent state cannot serve turned off (module doc); as it is
    for a model without one."""
    if not layers(model):
        return cfg
    if cfg.speculative:
        raise ConfigError(f"{type(model).__name__} keeps a recurrent state that rejected "
                          "draft tokens would leave behind: run it without speculative")
    off = {name: value for name, value in (("enable_prefix_cache", False),
                                           ("cuda_graphs", False),
                                           ("cpu_compiled_step", "off"))
           if getattr(cfg, name) != value}
    if off:
        log.info("%s keeps recurrent state: %s", type(model).__name__,
                 ", ".join(f"{k}={v}" for k, v in off.items()))
    return dataclasses.replace(cfg, **off)


def bind(model: torch.nn.Module, rows: int, device: torch.device, dtype: torch.dtype) -> int:
    """Give every recurrent layer its state tensors, ``rows`` rows each (zeros); returns
    their bytes."""
    total = 0
    for layer in layers(model):
        for name, (shape, fp32) in layer.state_shapes().items():
            t = torch.zeros(rows, *shape, device=device,
                            dtype=torch.float32 if fp32 else dtype)
            setattr(layer, name, t)
            total += t.numel() * t.element_size()
    return total


def spans() -> list[tuple[int, int, bool, int]]:
    """The step's sequences: (first token, end, starts at position 0, state row), read once a
    forward (every recurrent layer of it shares them)."""
    ctx = get_context()
    memo = ctx.attn.memo
    if "spans" not in memo:
        starts = ctx.attn.query_start.tolist()
        lens = ctx.attn.context_lens.tolist()
        rows = ctx.seq_rows.tolist()
        memo["spans"] = [(lo, hi, lens[s] == hi - lo, rows[s])
                         for s, (lo, hi) in enumerate(zip(starts, starts[1:])) if hi > lo]
    return memo["spans"]
