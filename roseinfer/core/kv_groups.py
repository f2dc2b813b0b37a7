"""Which layers share a block table: window layers hold blocks of their own, so that the
blocks their window has passed can go back to the pool while full layers keep theirs.

Layers are put in groups of one size, each group of one window (vLLM's hybrid KV cache
design): Gemma 3's 8 global and 40 window layers make 6 groups of 8. A block id of the
one pool holds K/V for the layers of one group, so the cache has one tensor per slot of
a group, not per layer, and a token costs each group a block slot. Group 0 has the
largest window (none, where some layer has none); every other group's block for a
sequence's i-th block is found on the device through group 0's (``remap``), so one block
table per sequence still serves every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

# More groups than this and per-step bookkeeping would grow with them: such a model
# (Qwen2 with one window layer in 28, say) keeps one table, windows bounding reads only.
MAX_GROUPS = 8


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]   # per group: the window its layers attend over
    layer_group: tuple[int, ...]      # per layer
    layer_slot: tuple[int, ...]       # per layer: its tensor among the group's
    size: int                         # layers (tensors) per group

    @classmethod
    def of(cls, windows: list[int | None]) -> "KVGroups":
        """Groups for layers with these windows (None: full attention)."""
        kinds = sorted(set(windows), key=lambda w: (w is not None, -(w or 0)))  # widest first
        size = min(windows.count(w) for w in kinds)
        groups, layer_group, layer_slot = [], [0] * len(windows), [0] * len(windows)
        for w in kinds:
            for n, layer in enumerate(i for i, lw in enumerate(windows) if lw == w):
                if n % size == 0:
                    groups.append(w)
                layer_group[layer], layer_slot[layer] = len(groups) - 1, n % size
        if len(groups) > MAX_GROUPS:
            return cls.single(len(windows))
        return cls(tuple(groups), tuple(layer_group), tuple(layer_slot), size)

    @classmethod
    def single(cls, num_layers: int) -> "KVGroups":
        """Every layer in one group that keeps all its blocks."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    def __len__(self) -> int:
        return len(self.windows)

    def describe(self) -> str:
        """For the start log: what a block holds, where window layers keep their own."""
        if len(self) == 1:
            return ""
        windows = ", ".join(f"{w}" if w else "all" for w in self.windows)
        return (f", {len(self)} KV groups of {self.size} layers a block (tokens kept: "
                f"{windows})")

    def max_tokens(self, num_blocks: int, block_size: int) -> int | None:
        """The longest sequence ``num_blocks`` hold (None: any length, every group has a
        window): full groups take a block per ``block_size`` tokens, each window group
        at most its window's blocks and two more (the first one partly passed, the last
        one partly filled)."""
        full = self.windows.count(None)
        if not full:
            return None
        kept = sum(-(-w // block_size) + 1 for w in self.windows if w is not None)
        return max(0, num_blocks - kept) // full * block_size
