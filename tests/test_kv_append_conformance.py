"""Every registered KV-append backend writes exactly what a row-by-row copy writes.

Each case starts from a freshly randomised cache (the "poison": a stray write
changes it), appends through the backend under test and, one row at a time,
into a copy, and compares every bit of both caches.
"""
import pathlib
import subprocess
import sys
import zlib

import pytest
import torch

from roseinfer.core.kv_cache import SlotBatch
from roseinfer.core.plugins import PluginRegistry
from roseinfer.models.quantization import FP8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = PluginRegistry()
BACKENDS = REGISTRY.names("kv_append")
NUM_BLOCKS, BLOCK_SIZE, NUM_ROWS = 6, 4, 5
NUM_Q_HEADS = 2  # heads of the fused qkv tensor that sit before K


def make_slots(layout, gen, num_sources):
    """Distinct destination slots (no two rows race) for one of the three shapes."""
    def ints(x):
        return x.to(torch.int32).to(DEVICE)

    if layout == "identity_shared":
        blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:NUM_ROWS]
        offset = torch.randint(BLOCK_SIZE, (1,), generator=gen)
        offset = ints(offset)
        return SlotBatch(ints(blocks), offset.expand(NUM_ROWS), shared_offset=offset)
    slot = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:NUM_ROWS]
    rows = None
    if layout == "gathered":
        rows = torch.randperm(num_sources, generator=gen)[:NUM_ROWS].to(DEVICE)
    return SlotBatch(ints(slot // BLOCK_SIZE), ints(slot % BLOCK_SIZE), rows=rows)


def make_key_value(gen, num_sources, num_kv_heads, head_dim, dtype, fused):
    """key/value [num_sources, H_kv, D]; `fused` makes them slices of one qkv tensor."""
    heads = NUM_Q_HEADS + 2 * num_kv_heads if fused else 2 * num_kv_heads
    x = torch.randn(num_sources, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    first = NUM_Q_HEADS if fused else 0
    key = x[:, first:first + num_kv_heads]
    value = x[:, first + num_kv_heads:first + 2 * num_kv_heads]
    if not fused:
        key, value = key.contiguous(), value.contiguous()
    return key, value


def served(request, backend_name, layout):
    """(generator, backend, slots, source rows) of a case; skipped where the backend
    does not serve the layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))
    num_sources = NUM_ROWS + 3 if layout == "gathered" else NUM_ROWS
    slots = make_slots(layout, gen, num_sources)
    backend = REGISTRY.create("kv_append", backend_name)
    if not backend.supports(slots, DEVICE):
        pytest.skip(f"{backend_name} does not serve {layout} on {DEVICE.type}")
    return gen, backend, slots, num_sources


def appended(gen, backend, slots, key, value, cache_dtype, stored=lambda x: x):
    """Random caches appended to through the backend, and copies of them row by row
    (each slot holding ``stored(row)``): (k, v, k_ref, v_ref)."""
    shape = (NUM_BLOCKS, key.shape[1], BLOCK_SIZE, key.shape[2])
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    backend.append(k_cache, v_cache, key, value, slots)
    rows = range(NUM_ROWS) if slots.rows is None else slots.rows.tolist()
    for i, row in enumerate(rows):
        b, o = int(slots.block_idx[i]), int(slots.offsets[i])
        k_ref[b, :, o] = stored(key[row])
        v_ref[b, :, o] = stored(value[row])
    return k_cache, v_cache, k_ref, v_ref


def assert_same_bits(*caches):
    k, v, k_ref, v_ref = (c.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[c.element_size()])
                          for c in caches)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "qkv_view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("layout", ["identity_varying", "identity_shared", "gathered"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_matches_row_by_row_copy(request, backend_name, layout, head_dim, num_kv_heads, dtype, fused):
    gen, backend, slots, num_sources = served(request, backend_name, layout)
    key, value = make_key_value(gen, num_sources, num_kv_heads, head_dim, dtype, fused)
    assert_same_bits(*appended(gen, backend, slots, key, value, dtype))


@pytest.mark.parametrize("layout", ["identity_varying", "identity_shared", "gathered"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_an_fp8_cache_takes_e4m3_values_saturated(request, backend_name, layout):
    """kv_cache_dtype fp8: each value rounded to e4m3 (scale 1), past 448 saturated. The
    values are e4m3's already, and 512 (past the largest): the Triton interpreter's
    rounding to e4m3 drops the carry when a value rounds up across a power of two."""
    gen, backend, slots, num_sources = served(request, backend_name, layout)
    key, value = make_key_value(gen, num_sources, 3, 64, torch.float16, True)
    key.copy_((key * 40).to(FP8).half())
    value.copy_((value * 40).to(FP8).half())
    key[0, 0, :4] = torch.tensor([512.0, -512.0, 448.0, -0.0])
    assert_same_bits(*appended(gen, backend, slots, key, value, FP8,
                               lambda x: x.clamp(-448, 448).to(FP8)))


def test_triton_plugins_register_nothing_without_triton():
    """CPU-only installs have no triton: the Triton plugin modules must still import."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "from roseinfer.plugins.kv_append import triton_append\n"
        "from roseinfer.plugins.attention import triton_paged\n"
        "names = []\n"
        "triton_append.roseinfer_register_kv_append_backends(lambda n, f: names.append(n))\n"
        "triton_paged.roseinfer_register_attention_backends(lambda n, f: names.append(n))\n"
        "assert names == [], names\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
