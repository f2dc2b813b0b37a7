"""Window layers keep only their window: KV groups, the block manager's window tables,
the prefix cache's rule for them, and an engine whose window layers let blocks go."""
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.core.blocks import BlockManager
from roseinfer.core.kv_groups import MAX_GROUPS, KVGroups
from roseinfer.core.plugins import default_registry
from tests.models import hf_greedy, tiny_family
from tests.test_blocks import make_seq

BS, W = 4, 8  # a window layer's query at p sees p - 7 .. p: two blocks and a bit


def test_groups_put_each_window_apart_widest_first():
    """Gemma 3's 5:1 pattern: the global layers make group 0, the window layers five
    groups of the same size; each layer has its own slot in its group."""
    windows = [1024 if i % 6 != 5 else None for i in range(48)]
    g = KVGroups.of(windows)
    assert g.windows == (None,) + (1024,) * 5 and g.size == 8
    assert [g.layer_group[i] for i in (5, 11, 0, 1, 47)] == [0, 0, 1, 1, 0]
    assert sorted(zip(g.layer_group, g.layer_slot)) == [(k, s) for k in range(6)
                                                         for s in range(8)]
    assert "6 KV groups of 8 layers" in g.describe()
    assert KVGroups.of([None] * 4) == KVGroups.single(4)
    assert KVGroups.single(4).describe() == ""
    assert KVGroups.of([16, 4, 16, 4]).windows == (16, 4)
    # one window layer in 28 would make 28 groups: one table instead
    assert KVGroups.of([None] * 27 + [4]) == KVGroups.single(28)
    assert len(KVGroups.of([None] * MAX_GROUPS + [4] * MAX_GROUPS * 2)) == 3


def test_max_tokens_counts_full_groups_and_window_groups_apart():
    g = KVGroups((None, W, W), (0, 1, 2), (0, 0, 0), 1)
    assert g.max_tokens(100, BS) == (100 - 2 * (W // BS + 1)) * BS
    assert KVGroups((W,), (0,), (0,), 1).max_tokens(100, BS) is None


class Mapping:
    """The device's view: group g's block for each group 0 block (runner.remap)."""

    def __init__(self):
        self.to = {}

    def __call__(self, group, b0, b):
        self.to[group, b0] = b


def manager(num_blocks=64, windows=(None, W), prefix_cache=True):
    store = default_registry().create("metadata", "arrays", num_blocks, BS)
    mapping = Mapping()
    copies = []
    bm = BlockManager(num_blocks, BS, store, prefix_cache,
                      lambda s, d: copies.append((s, d)), windows, mapping)
    return bm, mapping, copies


def grow(bm, seq, upto):
    """Compute the sequence token by token up to ``upto`` tokens, committing each."""
    while seq.num_computed < upto:
        assert bm.reserve(seq, 1)
        seq.num_computed += 1
        bm.commit(seq)


def check_mapped(bm, mapping, seq):
    """What the device reads for every block a window query may see."""
    for g, table in enumerate(bm.tables(seq)[1:], 1):
        for b0, b in zip(seq.block_table, table):
            if b != bm.null:
                assert mapping.to[g, b0] == b


def test_window_blocks_go_back_as_the_sequence_grows_and_full_ones_stay():
    bm, mapping, _ = manager()
    seq = make_seq("a", list(range(100, 160)))
    grow(bm, seq, 60)
    full, window = bm.tables(seq)
    assert len(full) == len(window) == 15 and bm.null not in full
    # position 59 sees 52..59: blocks 13 and 14 are held, the rest went back
    assert window[:13] == [bm.null] * 13 and bm.null not in window[13:]
    assert bm.num_free == 64 - 15 - 2
    check_mapped(bm, mapping, seq)
    bm.free_seq(seq)
    assert bm.num_free == 64


def test_a_window_only_model_holds_its_window_whatever_the_length():
    bm, _, _ = manager(num_blocks=6, windows=(W,))
    seq = make_seq("a", list(range(200)))
    grow(bm, seq, 200)  # 50 blocks' worth through a pool of 6
    assert bm.num_free >= 6 - 3


def test_a_cached_prefix_is_taken_where_its_window_blocks_are_still_held():
    bm, mapping, _ = manager()
    a = make_seq("a", list(range(100, 140)))
    grow(bm, a, 40)
    bm.free_seq(a)
    # the whole prompt: its last window's blocks were held to the end
    b = make_seq("b", list(range(100, 140)) + [7])
    b.num_computed = bm.match_prefix(b)
    assert b.num_computed == 40
    full, window = bm.tables(b)
    assert bm.null not in full and window[:8] == [bm.null] * 8 and bm.null not in window[8:]
    check_mapped(bm, mapping, b)
    bm.free_seq(b)
    # a prefix ending where ``a`` had let its window blocks go long ago: once the pool
    # hands them out again, that prefix is computed again (its global blocks alone do
    # not serve the window layers)
    c = make_seq("c", list(range(100, 120)) + [9, 9])
    assert bm.cached_tokens(c.token_ids) == 20
    filler = make_seq("f", [1] * 120)
    grow(bm, filler, 100)  # takes the free blocks, oldest released first
    assert bm.cached_tokens(c.token_ids) == 0
    assert bm.match_prefix(c) == 0 and c.block_table == []


def test_share_gives_a_sample_only_what_its_window_still_holds():
    """n samples share the first one's prompt blocks; where the first one ran past, the
    window blocks the others' queries need may be gone: they take fewer."""
    bm, mapping, _ = manager()
    first = make_seq("a", list(range(100, 141)))
    grow(bm, first, 41)
    child = make_seq("b", list(first.token_ids))
    bm.share(first, child, 10)
    assert child.num_computed == 40 and len(child.block_table) == 10
    grow(bm, first, 80)
    late = make_seq("c", list(first.token_ids[:41]))
    bm.share(first, late, 10)
    assert late.num_computed < 40
    table = bm.tables(late)[1]
    start = bm._first(1, late.num_computed)
    assert bm.null not in table[start:]
    check_mapped(bm, mapping, late)


def test_fork_then_copy_on_write_copies_each_groups_last_block_and_maps_it():
    bm, mapping, copies = manager()
    parent = make_seq("a", list(range(100, 110)))
    grow(bm, parent, 10)
    child = make_seq("b", list(parent.token_ids))
    bm.fork(parent, child)
    assert bm.reserve(child, 1)
    assert len(copies) == 2  # the partial last block of both groups
    assert [t[-1] for t in bm.tables(child)] == [d for _, d in copies]
    check_mapped(bm, mapping, child)
    check_mapped(bm, mapping, parent)


@pytest.fixture(scope="module")
def gemma3():
    return tiny_family("gemma3_text")


def test_an_engine_frees_window_blocks_while_decoding(gemma3):
    """Tiny Gemma 3 (4-token windows beside global layers): mid-generation, the window
    group holds its window's blocks only, the global group all of them; the tokens
    equal transformers'."""
    llm = LLM(gemma3, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              max_num_seqs=2)
    engine = llm.engine
    assert engine.kv_cache.groups.windows == (None, 4)
    prompt = list(range(3, 43))
    engine.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=0,
                                                  ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.seqs.get("r")
        if seq is not None and seq.num_computed:
            full, window = engine.blocks.tables(seq)
            held.append((seq.num_computed, sum(b != engine.blocks.null for b in full),
                         sum(b != engine.blocks.null for b in window)))
    last = held[-1]
    assert last[1] == -(-last[0] // 4) and last[2] <= 3, held
    # the prompt's step holds every block (its queries see them all), decoding 3 at most
    assert max(w for n, _, w in held if n > len(prompt)) <= 3 and last[0] > 50
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(gemma3, prompt, 24)
