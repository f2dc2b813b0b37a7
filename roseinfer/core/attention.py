"""Per-step attention metadata and the context the model layers read it from.

One step's query tokens are flattened across sequences (prefill chunks and
decode rows alike); token ``i`` of sequence ``s`` sits at position
``context_lens[s] - query_lens[s] + i`` and attends to cache positions up to
and including its own. K/V of the step are appended to the cache first.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

import torch

from roseinfer.core.kv_cache import KVCache, SlotBatch


@dataclass
class AttnMetadata:
    block_tables: torch.Tensor   # int32 [S, max_blocks]; unused entries are 0
    context_lens: torch.Tensor   # int32 [S]: cached tokens after this step
    query_start: torch.Tensor    # int32 [S + 1]: cumulative query lengths
    max_query_len: int
    max_context_len: int
    # int32 [query tokens]: the last key position each sees where past its own (an image's
    # tokens attending both ways, models/gemma3_vl.py), else -1; None: causal throughout
    visible: Optional[torch.Tensor] = None
    # What every layer of one forward derives alike (RoPE rows, gather indices),
    # computed by the first: the runner clears it before each forward.
    memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    def supports(self, device: torch.device) -> bool: ...

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                attn: AttnMetadata, scale: float) -> torch.Tensor:
        """q: [N, H, D] -> [N, H, D]; k/v_cache: [blocks, H_kv, block_size, D]."""


@dataclass
class StepContext:
    kv_cache: KVCache
    attention: AttentionBackend
    attn: AttnMetadata                   # KV group 0's (core/kv_groups.py)
    slots: SlotBatch
    groups: list[tuple[AttnMetadata, SlotBatch]] = field(default_factory=list)  # 1, 2, ...
    lora_slots: Optional[torch.Tensor] = None  # per token: its LoRA slot, -1 none (layers/lora.py)
    seq_rows: Optional[torch.Tensor] = None    # per sequence: its table (and state) row
    # What a model takes beside ids and positions (core/multimodal.py: image features)
    model_inputs: Optional[Any] = None

    def remap_groups(self, group_blocks: torch.Tensor) -> None:
        """Each other group's tables and slots: its blocks for group 0's
        (``group_blocks``, [groups - 1, blocks]), in one gather each."""
        tables = group_blocks[:, self.attn.block_tables]
        idx = group_blocks[:, self.slots.block_idx]
        self.groups = [(replace(self.attn, block_tables=t, memo={}),
                        replace(self.slots, block_idx=b, memo={})) for t, b in zip(tables, idx)]

    def of_group(self, group: int) -> AttnMetadata:
        return self.attn if group == 0 else self.groups[group - 1][0]


# Per thread: a CPU step compiles on a background thread while the loop steps the engine
# eagerly, and a process may step several engines (tests, a fleet in one process).
_local = threading.local()


def set_context(ctx: Optional[StepContext]) -> None:
    _local.context = ctx


def get_context() -> StepContext:
    ctx = getattr(_local, "context", None)
    assert ctx is not None, "model called outside an engine step"
    return ctx
