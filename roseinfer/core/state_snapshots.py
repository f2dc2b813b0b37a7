"""Recurrent states at block boundaries, kept under their block's hash, so that a prefix-cache
hit on a model with recurrent layers (core/recurrent.py) restores the state where its blocks
end: attention layers take their cached blocks, recurrent layers this state, and the prompt
goes on from there.

A snapshot is one more state row of every recurrent layer (rows after the sequences'), a
copy of a sequence's row taken right after the step whose last token ends a block. Which
boundaries are kept:

- the last full block of a prompt (a shared system prompt, a conversation's history), the
  prompt's chunk made to end there (``chunk``);
- while it decodes, the latest boundary a sequence passed, written over its previous one
  (a row a sequence), so that a conversation's next turn finds its history up to the last
  block of the reply.

Snapshots live in ``count`` rows, least recently used given back first; a boundary with no
snapshot is never a hit (``held``): its tokens are computed again, so no state is served
that its tokens did not make. The copies are queued on the device in step order: restores
before a step's forward, saves after it, so a row reused for a save never loses a restore
queued before.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from roseinfer.core import recurrent


class StateSnapshots:
    """Snapshot rows ``first .. first + count - 1`` of every recurrent layer's state."""

    def __init__(self, model: torch.nn.Module, first: int, count: int, block_size: int):
        self.tensors = [getattr(layer, name) for layer in recurrent.layers(model)
                        for name in layer.state_shapes()]
        self.block_size = block_size
        self.free = list(range(first, first + count))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # hash -> row, least recent first
        self.restoring: dict = {}  # sequence -> the row its first step starts from
        self.saved: dict = {}  # sequence -> [(position, row)] copied, not yet hashed
        self.latest: dict = {}  # sequence -> (hash, row) of its latest decode boundary

    def held(self, h: int) -> bool:
        return h in self.by_hash

    def restore(self, seq, h: int) -> None:
        """The sequence's next step starts from the snapshot of block hash ``h``."""
        self.by_hash.move_to_end(h)
        self.restoring[seq] = self.by_hash[h]

    def boundary(self, seq) -> int:
        """Where its prompt's snapshot is taken: its last full block that leaves a token to
        compute (what a prefix-cache hit can cover)."""
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def chunk(self, seq, n: int) -> int:
        """A prompt chunk of ``n`` tokens from ``seq.num_computed``, ended at the prompt's
        boundary where it would pass it."""
        start, end = seq.num_computed, self.boundary(seq)
        return end - start if start < end < start + n else n

    def restore_rows(self, seqs) -> None:
        """Queue the restores of the step's sequences (their rows given: after ``fill``)."""
        for seq in seqs:
            row = self.restoring.pop(seq, None)
            if row is not None:
                self._copy(row, seq.row)

    def save(self, seqs, num_tokens, step: int) -> None:
        """After the forward of window step ``step``: queue a copy of each sequence's row
        whose computed tokens now end a block at or past its prompt's boundary."""
        bs = self.block_size
        for seq, n in zip(seqs, num_tokens):
            end = seq.num_computed + n * (step + 1)
            if end % bs or end < self.boundary(seq):
                continue
            row = self._row_for(seq, end)
            if row is None:
                return
            self._copy(seq.row, row)
            self.saved.setdefault(seq, []).append((end, row))

    def published(self, seq, block: int, h: int) -> None:
        """Block ``block`` of the sequence is now known by hash ``h``
        (BlockManager.commit): a snapshot taken where it ends goes under that hash."""
        saved, end = self.saved.get(seq), (block + 1) * self.block_size
        while saved and saved[0][0] < end:  # not published (cannot happen): let it go
            self.free.append(saved.pop(0)[1])
        if not saved or saved[0][0] != end:
            return
        row = saved.pop(0)[1]
        if h in self.by_hash:  # another sequence's, of the same tokens
            self.free.append(row)
            return
        self.by_hash[h] = row
        if end > self.boundary(seq):  # a decode boundary: written over by the next
            self.latest[seq] = (h, row)

    def forget(self, seq) -> None:
        """The sequence let go of its blocks: snapshots copied but never hashed go back;
        its latest decode boundary stays (the next turn's)."""
        self.restoring.pop(seq, None)
        self.latest.pop(seq, None)
        self.free += [row for _, row in self.saved.pop(seq, ())]

    def _row_for(self, seq, end: int):
        """Where the snapshot at ``end`` goes: a decoding sequence's latest boundary is
        written over (it holds one row at most), any other takes a row."""
        latest = self.latest.pop(seq, None) if end > self.boundary(seq) else None
        if latest is None:
            return self._take()
        h, row = latest
        if self.by_hash.get(h) == row:
            del self.by_hash[h]
        return row

    def _take(self):
        if self.free:
            return self.free.pop()
        if self.by_hash:
            _, row = self.by_hash.popitem(last=False)
            for seq, (h, r) in list(self.latest.items()):
                if r == row:
                    del self.latest[seq]
            return row
        return None

    def _copy(self, src: int, dst: int) -> None:
        torch._foreach_copy_([t[dst] for t in self.tensors], [t[src] for t in self.tensors])
