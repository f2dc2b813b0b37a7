"""A decoder family (Llama, Qwen2, Qwen3, ...) run once over whole packed sequences for
pooling (Qwen3-Embedding: the last token's state), with no KV cache: the model's
attention layers append this step's K/V to a cache that only holds the step, and a
backend attends causally within each sequence."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roseinfer.core.attention import set_context
from roseinfer.layers.encoder_attention import Packed, packed_attention


class _StepKV:
    """The KV cache's interface over this step's K/V alone."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer] = (k, v)

    def layer(self, layer: int):
        k, v = self.kv[layer]
        return k, v, 0


class _CausalPacked:
    """An attention backend over the step's own K/V."""

    def forward(self, q, k, v, attn, scale, window=None, sinks=None, softcap=None):
        if window or sinks is not None or softcap:
            raise ValueError("pooling runs decoders without sliding windows, sinks or soft "
                             "caps; this model has one")
        return packed_attention(q, k, v, attn.packed, causal=True, scale=scale)


@dataclass
class _PackedAttn:
    packed: Packed
    memo: dict = field(default_factory=dict)  # what every layer derives alike (RoPE rows)
    is_decode: bool = False


@dataclass
class _Context:
    kv_cache: _StepKV
    attention: _CausalPacked
    attn: _PackedAttn
    lora_slots: None = None

    def of_group(self, group: int) -> _PackedAttn:
        return self.attn


def decoder_states(model, ids: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The final norm's output at every packed token [N, H]."""
    set_context(_Context(_StepKV(), _CausalPacked(), _PackedAttn(packed)))
    try:
        return model(ids, packed.positions)
    finally:
        set_context(None)
