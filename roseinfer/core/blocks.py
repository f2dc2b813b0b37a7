"""BlockManager: paged KV block allocation, refcounts, copy-on-write, prefix cache.

One block table per sequence serves every layer, so bookkeeping happens once
per step. Per-block fields live in a MetadataStore plugin. Freed blocks keep
their hash and go to the back of an LRU free list, so a later request with
the same prefix can take them back until they are reused; freed blocks with
no hash go to the front.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Optional, Protocol, Sequence as Seq

NO_HASH = -1


class MetadataStore(Protocol):
    """Per-block bookkeeping; created as ``factory(num_blocks, block_size)``."""

    def ref(self, block: int) -> int: ...
    def set_ref(self, block: int, n: int) -> None: ...
    def hash(self, block: int) -> int: ...
    def tokens(self, block: int) -> Seq[int]: ...
    def set_hash(self, block: int, h: int, tokens: Seq[int]) -> None: ...


def block_hash(parent: int, tokens: Seq[int]) -> int:
    # Python's hash of a tuple of ints is the same in every process of one Python
    # version (no hash seed for ints), so workers of a fleet can compare them.
    return hash((parent, tuple(tokens)))


def root_hash(lora: Optional[str]) -> int:
    """Where a sequence's block hashes chain from: K/V computed under one LoRA adapter
    (core/lora.py) are another adapter's, or the base model's, never. The adapter's name
    is hashed with a digest, stable across the processes of a fleet as Python's hash of a
    string is not."""
    if lora is None:
        return NO_HASH
    return int.from_bytes(hashlib.blake2b(lora.encode(), digest_size=8).digest(), "little",
                          signed=True)


def prompt_hashes(token_ids: Seq[int], block_size: int, root: int = NO_HASH) -> list[int]:
    """The hashes match_prefix looks up for a prompt: of each full block but the one
    holding its last token."""
    hashes, parent = [], root
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    """Block tables of sequences over one pool of ``num_blocks`` blocks.

    ``windows``: per KV group (core/kv_groups.py) the window its layers attend over, or
    None. A sequence holds a table per group (``block_table``, then ``group_tables``) of
    one length; a window group's entries that no query from ``num_computed`` on sees go
    back to the pool and read ``null`` (the scratch block). Group g's block for a
    sequence's i-th block is also recorded against group 0's (``remap(g, b0, b)``): the
    device finds it there.
    """

    def __init__(self, num_blocks: int, block_size: int, store: MetadataStore,
                 enable_prefix_cache: bool = True,
                 copy_block: Optional[Callable[[int, int], None]] = None,
                 windows: Seq[Optional[int]] = (None,),
                 remap: Callable[[int, int, int], None] = lambda group, b0, b: None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.store = store
        self.prefix_cache = enable_prefix_cache
        self.copy_block = copy_block
        self.windows = tuple(windows)
        self.windowed = [g for g, w in enumerate(self.windows) if w is not None]
        self.null = num_blocks
        self.remap = remap
        # per group g >= 1: its block for each block of group 0 (what the device reads)
        self.mapped = [[self.null] * (num_blocks + 1) for _ in self.windows[1:]]
        self.group_of = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.caches: list[dict[int, int]] = [{} for _ in self.windows]  # hash -> block
        # Changes to group 0's cache, (hash, cached?, a sequence's first block?) in order,
        # first blocks again when a prompt reuses them, while a frontend follows them (it
        # tells a fleet which prompts this engine holds: frontends/redis_streams/routing.py)
        self.journal: Optional[list[tuple[int, bool, bool]]] = None
        self.on_free_seq: Callable[[object], None] = lambda seq: None
        # A model with recurrent layers: their states at block boundaries
        # (core/state_snapshots.py); a prefix ends only where one is held
        self.states = None

    @property
    def cached(self) -> dict[int, int]:
        """Group 0's cached blocks by hash."""
        return self.caches[0]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def tables(self, seq) -> list[list[int]]:
        """The sequence's table of each group."""
        if len(seq.group_tables) != len(self.windows) - 1:
            seq.group_tables = [[] for _ in self.windows[1:]]
        return [seq.block_table, *seq.group_tables]

    def _first(self, group: int, computed: int) -> int:
        """The first block that group's queries from position ``computed`` on see."""
        w = self.windows[group]
        return 0 if w is None else max(0, (computed - w + 1) // self.block_size)

    def match_prefix(self, seq) -> int:
        """Take cached blocks for the sequence's leading full blocks; returns tokens covered.

        At least one token is left to compute, so the step still yields logits.
        """
        if not self.prefix_cache or seq.prompt_logprobs_due:  # every prompt token's logits
            return 0
        hashes, rows, k = self._prefix(seq.token_ids, seq.hash_root)
        tables = self.tables(seq)
        for g, table in enumerate(tables):
            first = self._first(g, k * self.block_size)
            table += [self.null] * first
            for row in rows[first:k]:
                self._take(row[g])
                table.append(row[g])
        seq.block_hashes += hashes[:k]
        if k and self.states is not None:
            self.states.restore(seq, hashes[k - 1])
        if k and tables[0][0] != self.null and self.journal is not None:
            self.journal.append((hashes[0], True, True))  # a prompt in use: listed as recent
        return k * self.block_size

    def chunk(self, seq, n: int) -> int:
        """A prompt chunk of ``n`` tokens, shortened where a recurrent state is to be kept
        inside it (StateSnapshots.chunk)."""
        return n if self.states is None else self.states.chunk(seq, n)

    def cached_tokens(self, token_ids: Seq[int], root: int = NO_HASH) -> int:
        """What match_prefix would cover now, taking nothing."""
        if not self.prefix_cache:
            return 0
        return self._prefix(token_ids, root)[2] * self.block_size

    def _prefix(self, token_ids: Seq[int], root: int) -> tuple[list[int], list[list], int]:
        """(hashes, each group's cached block of each (None if not held), k): the longest
        cached prefix of k full blocks, at least one token left to compute, for which every
        group holds the blocks its queries from there on see (a window group only its
        window's; a prefix longer than a window is reusable only where they are held)."""
        bs, parent, groups = self.block_size, root, range(len(self.windows))
        hashes, rows, runs, k = [], [], [0] * len(self.windows), 0
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs:(i + 1) * bs]
            parent = block_hash(parent, tokens)
            row = self._held(parent, tokens)
            hashes.append(parent)
            rows.append(row)
            restorable = self.states is None or self.states.held(parent)
            if not self.windowed:  # every group keeps its blocks: all held, or stop
                if None in row:
                    break
                k = i + 1 if restorable else k
                continue
            runs = [n + 1 if b is not None else 0 for n, b in zip(runs, row)]
            if restorable and all(runs[g] >= i + 1 - self._first(g, (i + 1) * bs)
                                  for g in groups):
                k = i + 1
            elif any(runs[g] <= i for g in groups if self.windows[g] is None):
                break  # a full group lacks a block: no longer prefix can be taken
        return hashes, rows, k

    def _held(self, h: int, tokens: Seq[int]) -> list:
        """Each group's cached block of hash ``h`` (None where none is): a group g >= 1
        block only where group 0's is cached and maps to it, as the device reads it."""
        b0 = self.caches[0].get(h)
        if b0 is None or list(self.store.tokens(b0)) != tokens:
            return [None] * len(self.windows)
        return [b0] + [b if (b := cache.get(h)) is not None and b == mapped[b0] else None
                       for cache, mapped in zip(self.caches[1:], self.mapped)]

    def reserve(self, seq, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` KV rows; False if blocks ran out.
        First, window groups give back the blocks no query from now on sees."""
        bs, table = self.block_size, seq.block_table
        need = -(-(seq.num_computed + num_new_tokens) // bs) - len(table)
        # a partial last block shared with another sequence (n samples)
        shared = seq.num_computed % bs and self.store.ref(table[-1]) > 1
        if need <= 0 and not shared and not self.windowed:
            return True  # most decode steps: kept to this
        tables = self.tables(seq)
        for g in self.windowed:
            self._let_go(tables[g], self._first(g, seq.num_computed))
        shared = [t for t in tables if t[-1] != self.null and self.store.ref(t[-1]) > 1] \
            if shared else ()
        if need * len(tables) + len(shared) > len(self.free):
            return False
        if shared:
            self._copy_last_blocks(seq, tables, shared)
        for _ in range(need):
            for g, t in enumerate(tables):
                t.append(self._allocate(g))
            self._map_last(tables)
        return True

    def _let_go(self, table: list[int], first: int) -> None:
        """Release a window group's blocks before ``first`` (those after the last null:
        earlier ones went before)."""
        i = min(first, len(table)) - 1
        while i >= 0 and table[i] != self.null:
            self._release(table[i])
            table[i] = self.null
            i -= 1

    def _copy_last_blocks(self, seq, tables: list[list[int]], shared: list[list[int]]) -> None:
        """Copy-on-write: partial last blocks shared with another sequence are copied."""
        for table in shared:
            last = table[-1]
            fresh = self._allocate(self.group_of[last])
            self.copy_block(last, fresh)
            self._release(last)
            table[-1] = fresh
        if shared[0] is tables[0]:
            seq.synced = min(seq.synced, len(tables[0]) - 1)
        self._map_last(tables)

    def _map_last(self, tables: list[list[int]]) -> None:
        """Record each group's last block against group 0's."""
        b0 = tables[0][-1]
        for g, table in enumerate(tables[1:], 1):
            if self.mapped[g - 1][b0] != table[-1]:
                self.mapped[g - 1][b0] = table[-1]
                self.remap(g, b0, table[-1])

    def commit(self, seq) -> None:
        """Publish hashes of blocks that became full and computed in this step."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        known = min(seq.num_computed, seq.num_tokens)  # ids of the step in flight are unknown
        if len(seq.block_hashes) >= known // bs:
            return  # no block became full: most steps
        tables = self.tables(seq)
        for i in range(len(seq.block_hashes), known // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, tokens)
            for g, table in enumerate(tables):
                b = table[i]
                if b == self.null:
                    continue  # its window passed it
                self.store.set_hash(b, h, tokens)
                if self.caches[g].setdefault(h, b) == b and g == 0 and self.journal is not None:
                    self.journal.append((h, True, i == 0))
            seq.block_hashes.append(h)
            if self.states is not None:
                self.states.published(seq, i, h)

    def fork(self, parent, child) -> None:
        """Child shares every block of the parent (partial last block included)."""
        self._share(parent, child, len(parent.block_table))
        child.num_computed = parent.num_computed

    def share(self, parent, child, num_blocks: int) -> None:
        """Child (holding no blocks) takes the parent's first ``num_blocks`` computed, or
        fewer, as many as the parent still holds what the child's queries see."""
        tables = self.tables(parent)
        while num_blocks and any(
                self.null in tables[g][self._first(g, num_blocks * self.block_size):num_blocks]
                for g in self.windowed):
            num_blocks -= 1
        self._share(parent, child, num_blocks)
        child.num_computed = num_blocks * self.block_size

    def _share(self, parent, child, num_blocks: int) -> None:
        for src, dst in zip(self.tables(parent), self.tables(child)):
            dst[:] = src[:num_blocks]
            for b in dst:
                if b != self.null:
                    self.store.set_ref(b, self.store.ref(b) + 1)
        child.block_hashes = parent.block_hashes[:num_blocks]

    def free_seq(self, seq) -> None:
        for table in self.tables(seq):
            for b in reversed(table):  # tail blocks are least likely to be shared
                if b != self.null:
                    self._release(b)
            table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0
        if self.states is not None:
            self.states.forget(seq)
        self.on_free_seq(seq)

    def _take(self, b: int) -> None:
        n = self.store.ref(b)
        if n == 0:
            del self.free[b]
        self.store.set_ref(b, n + 1)

    def _allocate(self, group: int = 0) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.store.hash(b)
        if h != NO_HASH:
            was = self.group_of[b]
            if self.caches[was].get(h) == b:
                del self.caches[was][h]
                if was == 0 and self.journal is not None:
                    self.journal.append((h, False, False))
            self.store.set_hash(b, NO_HASH, ())
        self.group_of[b] = group
        self.store.set_ref(b, 1)
        return b

    def _release(self, b: int) -> None:
        n = self.store.ref(b) - 1
        self.store.set_ref(b, n)
        if n == 0:
            self.free[b] = None
            if self.store.hash(b) == NO_HASH:
                # Nothing in it to reuse: hand it out next. Its memory is warm and, on
                # the CPU, mapped; a block not written before costs a page fault per
                # head in every layer on first write.
                self.free.move_to_end(b, last=False)
