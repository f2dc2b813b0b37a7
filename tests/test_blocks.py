"""BlockManager and metadata stores: refcounts, prefix cache, copy-on-write, freeing."""
import pytest
import torch

from roseinfer.core.blocks import NO_HASH, BlockManager, prompt_hashes
from roseinfer.core.plugins import default_registry
from roseinfer.core.request import Sequence
from roseinfer.core.sampling import SamplingParams

STORES = default_registry().names("metadata")


def make_seq(rid, tokens):
    return Sequence(rid, tokens, SamplingParams(), 1000, 0.0)


def manager(store, num_blocks=8, bs=4, copy_block=None):
    s = default_registry().create("metadata", store, num_blocks, bs)
    return BlockManager(num_blocks, bs, s, True, copy_block)


def run_prefill(bm, seq):
    seq.num_computed = bm.match_prefix(seq)
    assert bm.reserve(seq, seq.num_tokens - seq.num_computed)
    seq.num_computed = seq.num_tokens
    bm.commit(seq)


@pytest.mark.parametrize("store", STORES)
def test_store_round_trips_fields(store):
    s = default_registry().create("metadata", store, 4, 3)
    assert [s.ref(b) for b in range(4)] == [0] * 4
    assert s.hash(2) == NO_HASH
    s.set_ref(2, 3)
    s.set_hash(2, 12345, [7, 8, 9])
    assert (s.ref(2), s.hash(2), list(s.tokens(2))) == (3, 12345, [7, 8, 9])
    s.set_hash(2, NO_HASH, ())
    assert (s.hash(2), list(s.tokens(2))) == (NO_HASH, [])


@pytest.mark.parametrize("store", STORES)
def test_prefix_hits_share_full_blocks_only(store):
    bm = manager(store)
    a = make_seq("a", list(range(10)))           # blocks [0..3] [4..7] [8, 9]
    run_prefill(bm, a)
    assert len(bm.cached) == 2
    b = make_seq("b", list(range(8)) + [50])
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.store.ref(x) for x in a.block_table] == [2, 2, 1]


@pytest.mark.parametrize("store", STORES)
def test_full_prompt_hit_leaves_last_block_to_compute(store):
    bm = manager(store)
    run_prefill(bm, make_seq("a", list(range(8))))
    b = make_seq("b", list(range(8)))
    assert bm.match_prefix(b) == 4  # the last token must be computed for logits


@pytest.mark.parametrize("store", STORES)
def test_freed_blocks_stay_cached_until_reused(store):
    bm = manager(store, num_blocks=4)
    a = make_seq("a", list(range(8)))
    run_prefill(bm, a)
    bm.free_seq(a)
    assert bm.num_free == 4
    b = make_seq("b", list(range(8)) + [9])
    assert bm.match_prefix(b) == 8 and bm.num_free == 2
    bm.free_seq(b)
    filler = make_seq("c", list(range(100, 116)))  # needs all four blocks: evicts the cache
    run_prefill(bm, filler)
    assert bm.cached == {h: blk for h, blk in bm.cached.items() if blk in filler.block_table}
    assert bm.match_prefix(make_seq("d", list(range(8)) + [9])) == 0


def test_the_journal_follows_the_cache_and_prompts_in_use():
    """What a worker tells its fleet (frontends/redis_streams/routing.py): blocks cached
    and evicted in order, first blocks marked, and a first block again when reused."""
    bm = manager("slots", num_blocks=4)
    bm.journal = []
    a = make_seq("a", list(range(9)))
    run_prefill(bm, a)
    h0, h1 = prompt_hashes(list(range(9)), 4)
    assert bm.journal == [(h0, True, True), (h1, True, False)]
    bm.free_seq(a)
    bm.journal.clear()
    b = make_seq("b", list(range(9)))
    assert bm.match_prefix(b) == 8
    assert bm.journal == [(h0, True, True)]
    bm.free_seq(b)
    bm.journal.clear()
    run_prefill(bm, make_seq("c", list(range(100, 116))))  # evicts both
    assert {(h, cached) for h, cached, _ in bm.journal if not cached} == {(h0, False), (h1, False)}
    assert prompt_hashes(list(range(9)), 4) == [h0, h1]  # deterministic across calls


@pytest.mark.parametrize("store", STORES)
def test_blocks_freed_without_a_hash_are_handed_out_first(store):
    """Blocks with nothing cached in them come back before never-used ones (their
    memory is mapped already) and before blocks that hold a cached prefix."""
    bm = manager(store, num_blocks=8)
    cached = make_seq("a", list(range(8)))       # two full blocks: both get a hash
    run_prefill(bm, cached)
    partial = make_seq("b", [50, 51, 52])        # one partial block: no hash
    run_prefill(bm, partial)
    used = partial.block_table[0]
    bm.free_seq(cached)
    bm.free_seq(partial)
    nxt = make_seq("c", [60, 61, 62])
    run_prefill(bm, nxt)
    assert nxt.block_table == [used]
    assert bm.match_prefix(make_seq("d", list(range(8)) + [9])) == 8


@pytest.mark.parametrize("store", STORES)
def test_copy_on_write_of_shared_partial_block(store):
    cache = torch.arange(8.0)[:, None].repeat(1, 3)   # one row of "KV" per block
    copies = []

    def copy_block(src, dst):
        copies.append((src, dst))
        cache[dst] = cache[src]

    bm = manager(store, copy_block=copy_block)
    parent = make_seq("p", [1, 2, 3, 4, 5, 6])        # second block half full
    run_prefill(bm, parent)
    child = make_seq("c", [1, 2, 3, 4, 5, 6])
    bm.fork(parent, child)
    shared_tail = parent.block_table[1]
    assert bm.store.ref(shared_tail) == 2
    child.token_ids.append(7)
    assert bm.reserve(child, 1)
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != shared_tail
    assert copies == [(shared_tail, child.block_table[1])]
    assert torch.equal(cache[child.block_table[1]], cache[shared_tail])
    assert bm.store.ref(shared_tail) == 1 and bm.store.ref(parent.block_table[0]) == 2


@pytest.mark.parametrize("store", STORES)
def test_reserve_fails_cleanly_when_pool_is_exhausted(store):
    bm = manager(store, num_blocks=2)
    a = make_seq("a", list(range(9)))
    assert not bm.reserve(a, 9)
    assert a.block_table == [] and bm.num_free == 2
