"""LoRA on a model's projections, many adapters in one batch.

Each adapted projection becomes a ``LoraLinear``: the base projection, plus a fixed
table of adapter slots, A and B of every slot, filled and emptied as adapters come and
go (core/lora.py). A step's tokens name their slot (-1: none) and each projection adds
its slots' products to the base output in two launches (layers/lora_kernels.py). The
tables' addresses never change, so the steps' CUDA graphs hold these launches. A step
where no token has an adapter runs the base alone (its context has no ``lora_slots``):
decode graphs are captured both ways (core/cuda_graphs.py).
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from roseinfer.core.attention import get_context
from roseinfer.core.errors import ConfigError
from roseinfer.layers.lora_kernels import LoraBatch, add_lora, shrink
from roseinfer.layers.skinny_linear import BLOCK_N as SKINNY_BLOCK_N, SkinnyLinear, \
    skinny_linear
from roseinfer.models.lora_adapter import SLICES


class LoraLinear(nn.Module):
    """``base`` and ``slots`` adapter slots of up to ``rank``; ``widths``: the outputs of
    each slice (q, k and v of a fused qkv projection) on this rank."""

    def __init__(self, base: nn.Module, widths: list[int], slots: int, rank: int,
                 dtype: torch.dtype):
        super().__init__()
        device = next(base.parameters()).device
        self.base, self.slots = base, slots
        self.offsets = tuple(itertools.accumulate(widths, initial=0))
        # a skinny kernel's tile of columns lies in one slice (skinny_linear's lora)
        self.skinny_aligned = all(o % SKINNY_BLOCK_N == 0 for o in self.offsets)
        self.register_buffer("ends", torch.tensor(self.offsets, dtype=torch.int32, device=device))
        self.register_buffer("lora_a", torch.zeros(len(widths), slots, rank, base.in_features,
                                                   dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(len(widths), slots, max(widths), rank,
                                                   dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if get_context().lora_slots is None:  # no adapter this step: no products to add
            return self.base(x, *args, **kwargs)
        batch = step_batch(self.slots)
        if self._in_skinny(x):  # the expand in the linear's own launch: one launch fewer
            rank = self.lora_a.shape[2]
            return skinny_linear(x, self.base.weight, self.base.bias, lora=(
                shrink(x, self.lora_a, batch), self.lora_b, batch.slots, self.ends, rank),
                split=self.base.split)
        y = self.base(x, *args, **kwargs)
        add_lora(y, x, self.lora_a, self.lora_b, self.offsets, self.ends, batch)
        return y

    def _in_skinny(self, x: torch.Tensor) -> bool:
        base = self.base
        return (self.skinny_aligned and isinstance(base, SkinnyLinear) and x.dim() == 2
                and x.stride(1) == 1 and x.shape[0] <= base.max_rows and x.is_cuda)

    def pack(self, parts: list, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's ``parts`` (per slice: (A, B), or None for no product) as one
        slot's A and B, zero-padded: a slot then fills in two copies."""
        a = torch.zeros(self.lora_a[:, 0].shape, dtype=self.lora_a.dtype, pin_memory=pin)
        b = torch.zeros(self.lora_b[:, 0].shape, dtype=self.lora_b.dtype, pin_memory=pin)
        for s, pair in enumerate(parts):
            if pair is not None:
                a[s, :pair[0].shape[0]] = pair[0]
                b[s, :pair[1].shape[0], :pair[1].shape[1]] = pair[1]
        return a, b

    def load(self, slot: int, packed: tuple | None) -> None:
        """Slot ``slot`` holds ``packed`` (pack's), or nothing (None: no product)."""
        if packed is None:
            self.lora_a[:, slot].zero_()
            self.lora_b[:, slot].zero_()
            return
        self.lora_a[:, slot].copy_(packed[0], non_blocking=True)
        self.lora_b[:, slot].copy_(packed[1], non_blocking=True)


def step_batch(slots: int) -> LoraBatch:
    """The running step's tokens grouped by slot: the first adapted projection of each
    forward groups them, the others reuse it."""
    ctx = get_context()
    memo = ctx.attn.memo
    batch = memo.get("lora")
    if batch is None:
        batch = memo["lora"] = LoraBatch(ctx.lora_slots, slots)
    return batch


def attach(model: nn.Module, slots: int, rank: int, dtype: torch.dtype
           ) -> dict[tuple[int, str], LoraLinear]:
    """Wrap every projection adapters may change (q/k/v, o, gate/up, down of each layer
    that has them: a mixture of experts' MLP has none) in a LoraLinear; returns them by
    (layer, projection name)."""
    found = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        for name, n in SLICES.items():
            base = getattr(layer, name, None)
            if not isinstance(base, nn.Linear) and not hasattr(base, "in_features"):
                continue
            out = base.out_features
            widths = [layer.q_size, layer.kv_size, layer.kv_size] if name == "qkv_proj" \
                else [out // n] * n
            found[i, name] = LoraLinear(base, widths, slots, rank, dtype)
            setattr(layer, name, found[i, name])
    if not found:
        raise ConfigError(f"enable_lora: {type(model).__name__} has no projections LoRA "
                          "adapters apply to here; adapters serve the Llama-family models "
                          "(Llama, Mistral, Qwen, Gemma, and the attention of the mixtures "
                          "of experts)")
    return found
