"""The recurrent-state cache: beside the paged K/V of attention layers, each sequence's
fixed-size state in every layer that keeps one (Mamba2's convolution inputs and SSM
state, layers/mamba2.py), a row a sequence.

A state row is the sequence's block-table row (core/step_inputs.py, ``TableRows``): it is
given with the row when the sequence is admitted and goes back with it, preempted or
finished, so the cache needs no bookkeeping of its own. A layer finds its sequences' rows
in the step context (``StepContext.seq_rows``) and starts from zeros where a sequence's
step starts at position 0.

A prefix-cache hit restores the state a snapshot kept at the hit's last block
(core/state_snapshots.py: ``SNAPSHOTS_PER_SEQ`` rows a sequence seat, after the
sequences' rows). What a state cannot do yet, the engine turns off for such a model
(``decided``): drafts that are rejected would leave their tokens in the state, so
speculative decoding is refused; samples of one prompt each compute it (or hit its
snapshot), not share its first sample's blocks. A prompt's chunk runs a batch of its own
and a step's decoding sequences one batch together (``batches``). Decode steps read nothing
of their shape on the host, so they run as CUDA graphs; steps with prompt chunks read it,
so they run eagerly (no mixed graphs), and so does the CPU (no compiled step). A decode
graph runs one step (no windows): a snapshot is copied after the step that ends a block.
"""
from __future__ import annotations

import torch

from roseinfer.core import tp
from roseinfer.core.attention import get_context
from roseinfer.core.config import turned_off
from roseinfer.core.errors import ConfigError


def refuse_tensor_parallel(family: str) -> None:
    """A family whose recurrent layers are not split over ranks yet refuses a group of
    more than one, by name."""
    if tp.group().size > 1:
        raise ConfigError(f"{family}: tensor parallelism is not built for its recurrent "
                          "layers yet; run it with tensor_parallel_size 1")


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
    return turned_off(cfg, f"{type(model).__name__} keeps recurrent state",
                      {"mixed_graph_max_tokens": 0, "decode_steps": 1,
                       "cpu_compiled_step": "off"})


SNAPSHOTS_PER_SEQ = 1  # snapshot rows a sequence seat (max_num_seqs), with the prefix cache on


def snapshot_rows(cfg, model: torch.nn.Module) -> int:
    """Rows of states kept at block boundaries, for prefix-cache hits to restore."""
    return SNAPSHOTS_PER_SEQ * cfg.max_num_seqs if cfg.enable_prefix_cache and layers(model) \
        else 0


def bind(model: torch.nn.Module, rows: int, device: torch.device, dtype: torch.dtype) -> int:
    """Give every recurrent layer its state tensors, ``rows`` rows each (zeros): the
    sequences' rows, then the snapshots' (core/state_snapshots.py); returns their bytes."""
    total = 0
    for layer in layers(model):
        for name, (shape, fp32) in layer.state_shapes().items():
            t = torch.zeros(rows, *shape, device=device,
                            dtype=torch.float32 if fp32 else dtype)
            setattr(layer, name, t)
            total += t.numel() * t.element_size()
    return total


def batches() -> list[tuple[torch.Tensor, bool | torch.Tensor, torch.Tensor]]:
    """The step's sequences as a recurrent layer takes them: (token indices [B, T], whether
    they start at position 0, their state rows [B]). Every one-token sequence that goes on
    from its state (decode) is in one batch; the others are a batch each. Read once a
    forward: every recurrent layer of it shares them."""
    ctx = get_context()
    memo = ctx.attn.memo
    if "recurrent" not in memo and ctx.attn.is_decode:
        memo["recurrent"] = [_decode_batch(ctx)]
    if "recurrent" not in memo:
        starts = ctx.attn.query_start.tolist()
        lens = ctx.attn.context_lens.tolist()
        rows = ctx.seq_rows.tolist()
        device = ctx.attn.query_start.device
        decode, out = [], []
        for s, (lo, hi) in enumerate(zip(starts, starts[1:])):
            fresh = lens[s] == hi - lo
            if hi - lo == 1 and not fresh:
                decode.append((lo, rows[s]))
            elif hi > lo:
                out.append((torch.arange(lo, hi, device=device)[None], fresh,
                            torch.tensor([rows[s]], device=device)))
        if decode:
            tokens, state_rows = zip(*decode)
            out.append((torch.tensor(tokens, device=device)[:, None], False,
                        torch.tensor(state_rows, device=device)))
        memo["recurrent"] = out
    return memo["recurrent"]


def over_batches(run, *inputs: torch.Tensor) -> torch.Tensor:
    """``run(*inputs [B, T, ...], fresh, rows)`` over the step's batches (``batches``), each
    input [tokens, ...] taken at the batch's token indices, the outputs [B, T, ...] put back
    in token order. A decode step is one batch of every token in order: its inputs go as
    views and its output is the result (no gathers, no scatter: launches a layer saved)."""
    parts = batches()
    if get_context().attn.is_decode:
        (_, fresh, rows), = parts
        return run(*(x[:, None] for x in inputs), fresh, rows)[:, 0]
    out = None
    for idx, fresh, rows in parts:
        y = run(*(x[idx] for x in inputs), fresh, rows)
        if out is None:
            out = y.new_zeros(inputs[0].shape[0], *y.shape[2:])
        out[idx] = y
    return out


def _decode_batch(ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of one token a sequence as one batch, on the device alone (a decode graph
    captures it): where a sequence's token is its first (a one-token prompt), a mask."""
    n = ctx.attn.num_seqs
    tokens = torch.arange(n, device=ctx.attn.context_lens.device)[:, None]
    return tokens, ctx.attn.context_lens == 1, ctx.seq_rows[:n]
