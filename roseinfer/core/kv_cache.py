"""Paged KV cache tensors; new rows are written through a KV-append backend.

Layout per slot of a KV group (core/kv_groups.py; one group, one slot per layer, where
no layer has a window): ``[num_blocks, num_kv_heads, block_size, head_dim]``.
"""
from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from roseinfer.core.kv_groups import KVGroups


@dataclass
class SlotBatch:
    """Where each new K/V row goes, built once per step and shared by all layers.

    Row ``i`` of ``key``/``value`` (or row ``rows[i]`` when ``rows`` is given)
    is written to ``cache[block_idx[i], :, offsets[i], :]``.
    ``shared_offset`` (shape ``[1]``) is set when every offset is equal and
    rows are the identity: the case the full-batch kernel serves.
    """

    block_idx: torch.Tensor
    offsets: torch.Tensor
    rows: Optional[torch.Tensor] = None
    shared_offset: Optional[torch.Tensor] = None
    # What a backend derives from the slots alike for every layer, computed by the first.
    memo: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return self.block_idx.shape[0]


class KVAppendBackend(Protocol):
    def supports(self, slots: SlotBatch, device: torch.device) -> bool: ...

    def append(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, slots: SlotBatch) -> None: ...


# "auto" tries these in order and takes the first that supports the batch.
AUTO_ORDER = ("triton_full_batch", "triton_identity_pos", "triton_generic", "torch_index")


class KVCache:
    def __init__(self, groups: KVGroups, num_blocks, num_kv_heads, block_size, head_dim,
                 dtype, device, backends: dict[str, KVAppendBackend], choice: str = "auto",
                 values_are_keys: bool = False):
        # One block more than the block manager hands out: the scratch block that
        # CUDA-graph padding rows write to, and window groups' tables read where their
        # window let a block go.
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.scratch_block = num_blocks
        self.groups = groups
        self.num_layers = len(groups.layer_slot)
        self.k = [_zeros(shape, dtype, device) for _ in range(groups.size)]
        # Latent attention's rows serve as keys and as values (layers/mla.py): one tensor.
        self.v = self.k if values_are_keys else [_zeros(shape, dtype, device)
                                                 for _ in range(groups.size)]
        self.values_are_keys = values_are_keys
        # per layer, looked up once: (its K, its V, its group)
        self._layers = [(self.k[s], self.v[s], g)
                        for s, g in zip(groups.layer_slot, groups.layer_group)]
        self.device = torch.device(device)
        self.block_size = block_size
        self.backends = backends
        self.choice = choice
        self._active: KVAppendBackend | None = None
        self._slots: tuple[SlotBatch, ...] = ()  # per group
        self.steps_by_backend: Counter[str] = Counter()
        self._forced: str | None = None

    def begin_step(self, slots: SlotBatch, group_slots: tuple[SlotBatch, ...] = ()) -> str:
        """Pick the backend for this step's batch shape; returns its name. ``slots``:
        group 0's, ``group_slots`` the other groups' (the same offsets, their blocks).

        A backend chosen by name serves every batch it supports; the others
        (e.g. prefill batches for the full-batch kernel) go the "auto" way.
        """
        name = self._forced or self.select(slots)
        self._active, self._slots = self.backends[name], (slots, *group_slots)
        self.steps_by_backend[name] += 1
        return name

    def select(self, slots: SlotBatch) -> str:
        name = self.choice
        if name == "auto" or not self.backends[name].supports(slots, self.device):
            name = self._auto(slots)
        return name

    def force(self, name: str | None) -> None:
        """Use ``name`` for every step until ``force(None)`` (CUDA-graph capture)."""
        self._forced = name

    def _auto(self, slots: SlotBatch) -> str:
        if self.device.type != "cuda":
            return "torch_index"  # Triton on CPU only runs interpreted: for tests
        for name in AUTO_ORDER:
            b = self.backends.get(name)
            if b is not None and b.supports(slots, self.device):
                return name
        raise RuntimeError("no KV-append backend supports this batch")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The layer's K and V tensors (its slot's in its group), and its group."""
        return self._layers[layer]

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's rows; where values are the keys, ``value`` is ``key`` and the
        second write lands on the first (the backends know one layout)."""
        k, v, group = self._layers[layer]
        self._active.append(k, v, key, value, self._slots[group])

    def append_rotated(self, layer: int, q: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, rotation) -> bool:
        """RoPE of q and key and the write of key and value in one launch, where the
        step's backend offers it (``append_rotated``: the Triton ones, for batches whose
        rows are the slots'); False, nothing done, where it does not. ``q``, ``key``,
        ``value``: [N, heads * head_dim] (column slices of a fused qkv serve)."""
        fused = getattr(self._active, "append_rotated", None)
        if fused is None:
            return False
        k, v, group = self._layers[layer]
        return fused(k, v, q, key, value, self._slots[group], rotation)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate one block in every slot (a block is one group's)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            if v is not k:
                v[dst].copy_(v[src])


def cache_rows(block_idx: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int,
               block_size: int) -> torch.Tensor:
    """[N, H_kv]: where token i's head h lies in a layer's cache seen as
    [blocks * H_kv * block_size, head_dim], for the token at ``offsets[i]`` of
    block ``block_idx[i]``. One index op then moves many tokens' rows at once."""
    head = torch.arange(num_kv_heads, device=block_idx.device)
    return (block_idx.long()[:, None] * num_kv_heads + head) * block_size + offsets.long()[:, None]


def _zeros(shape, dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU, anonymous memory from the OS: zero
    already, and faulted in as blocks are first written (torch.zeros writes
    every page up front: 2.3 s for the default 2 GiB cache on a 2-core VM)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(torch.Size(shape).numel() * dtype.itemsize, 1)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
