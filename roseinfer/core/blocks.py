"""BlockManager: paged KV block allocation, refcounts, copy-on-write, prefix cache.

One block table per sequence serves every layer, so bookkeeping happens once
per step. Per-block fields live in a MetadataStore plugin. Freed blocks keep
their hash and go to the back of an LRU free list, so a later request with
the same prefix can take them back until they are reused; freed blocks with
no hash go to the front.
"""
from __future__ import annotations

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


def prompt_hashes(token_ids: Seq[int], block_size: int) -> list[int]:
    """The hashes match_prefix looks up for a prompt: of each full block but the one
    holding its last token."""
    hashes, parent = [], NO_HASH
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, store: MetadataStore,
                 enable_prefix_cache: bool = True,
                 copy_block: Optional[Callable[[int, int], None]] = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.store = store
        self.prefix_cache = enable_prefix_cache
        self.copy_block = copy_block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Changes to `cached`, (hash, cached?, a sequence's first block?) in order, first
        # blocks again when a prompt reuses them, while a frontend follows them (it tells a
        # fleet which prompts this engine holds: frontends/redis_streams/routing.py)
        self.journal: Optional[list[tuple[int, bool, bool]]] = None
        self.on_free_seq: Callable[[object], None] = lambda seq: None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def match_prefix(self, seq) -> int:
        """Take cached blocks for the sequence's leading full blocks; returns tokens covered.

        At least one token is left to compute, so the step still yields logits.
        """
        if not self.prefix_cache or seq.prompt_logprobs_due:  # every prompt token's logits
            return 0
        for i, (h, b) in enumerate(self._cached_blocks(seq.token_ids)):
            self._take(b)
            seq.block_table.append(b)
            seq.block_hashes.append(h)
            if i == 0 and self.journal is not None:  # a prompt in use: listed as recent again
                self.journal.append((h, True, True))
        return len(seq.block_table) * self.block_size

    def cached_tokens(self, token_ids: Seq[int]) -> int:
        """What match_prefix would cover now, taking nothing."""
        if not self.prefix_cache:
            return 0
        return sum(1 for _ in self._cached_blocks(token_ids)) * self.block_size

    def _cached_blocks(self, token_ids: Seq[int]):
        """(hash, block) of the leading full blocks the cache holds, leaving at least one
        token to compute."""
        bs, parent = self.block_size, NO_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, tokens)
            b = self.cached.get(h)
            if b is None or list(self.store.tokens(b)) != tokens:
                return
            yield h, b
            parent = h

    def reserve(self, seq, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` KV rows; False if blocks ran out."""
        table, bs = seq.block_table, self.block_size
        need = -(-(seq.num_computed + num_new_tokens) // bs) - len(table)
        if need > len(self.free):
            return False
        if (seq.num_computed % bs and self.store.ref(table[-1]) > 1
                and not self._copy_last_block(seq, need)):
            return False
        for _ in range(need):
            table.append(self._allocate())
        return True

    def _copy_last_block(self, seq, need: int) -> bool:
        """Copy-on-write: a partial block shared with another sequence is copied first."""
        last = seq.block_table[-1]
        if need + 1 > len(self.free):
            return False
        fresh = self._allocate()
        self.copy_block(last, fresh)
        self._release(last)
        seq.block_table[-1] = fresh
        seq.synced = min(seq.synced, len(seq.block_table) - 1)
        return True

    def commit(self, seq) -> None:
        """Publish hashes of blocks that became full and computed in this step."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        known = min(seq.num_computed, seq.num_tokens)  # ids of the step in flight are unknown
        for i in range(len(seq.block_hashes), known // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, tokens)
            b = seq.block_table[i]
            self.store.set_hash(b, h, tokens)
            if self.cached.setdefault(h, b) == b and self.journal is not None:
                self.journal.append((h, True, i == 0))
            seq.block_hashes.append(h)

    def fork(self, parent, child) -> None:
        """Child shares every block of the parent (partial last block included)."""
        self.share(parent, child, len(parent.block_table))
        child.num_computed = parent.num_computed

    def share(self, parent, child, num_blocks: int) -> None:
        """Child (holding no blocks) takes the parent's first ``num_blocks``, computed."""
        for b in parent.block_table[:num_blocks]:
            self.store.set_ref(b, self.store.ref(b) + 1)
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_blocks]
        child.num_computed = num_blocks * self.block_size

    def free_seq(self, seq) -> None:
        for b in reversed(seq.block_table):  # tail blocks are least likely to be shared
            self._release(b)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0
        self.on_free_seq(seq)

    def _take(self, b: int) -> None:
        n = self.store.ref(b)
        if n == 0:
            del self.free[b]
        self.store.set_ref(b, n + 1)

    def _allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.store.hash(b)
        if h != NO_HASH:
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.journal is not None:
                    self.journal.append((h, False, False))
            self.store.set_hash(b, NO_HASH, ())
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
