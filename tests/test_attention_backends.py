"""Every registered attention backend against a float64 reference, one sequence at a time.

Batches mix prefill chunks over a cached prefix with decode rows, K/V blocks
are scattered at random through the cache, and q is a view of a fused qkv
tensor, as the models hand it over.
"""
import math
import os
import zlib

import pytest
import torch

from roseinfer.core.attention import AttnMetadata
from roseinfer.core.plugins import PluginRegistry

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
REGISTRY = PluginRegistry()
BACKENDS = REGISTRY.names("attention")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (context_len, query_len) per sequence: context includes this step's queries.
BATCHES = {
    "decode": [(1, 1), (7, 1), (13, 1), (20, 1)],
    "decode_one": [(37, 1)],  # one sequence: torch_sdpa gathers its rows without padding
    "prefill_prefix": [(12, 5), (9, 9), (70, 40)],
    "mixed": [(10, 1), (45, 6), (1, 1), (25, 25), (5, 1)],
}
# Long decode contexts: split across programs (see test_long_decode_is_split).
LONG_DECODE = [(1000, 1), (300, 1)]
if CUDA:  # compiled kernels: afford realistic sizes as well
    BATCHES["large_mixed"] = [(700, 300), (2000, 1), (513, 513), (64, 1)] * 3
    LONG_DECODE = [(9000, 1), (3000, 1), (17, 1), (4500, 1)] * 4


def visible(seqs, spans):
    """Each query's last visible key past its own position (-1: none): an image's tokens,
    ``spans`` [start, end) per sequence, see on to the image's last."""
    out = []
    for (context_len, query_len), runs in zip(seqs, spans):
        pos = torch.arange(context_len - query_len, context_len)
        last = torch.full_like(pos, -1)
        for start, end in runs:
            last[(pos >= start) & (pos < end)] = end - 1
        out.append(last)
    return torch.cat(out)


def reference(q, k_cache, v_cache, block_tables, seqs, scale, window=None, sinks=None,
              softcap=None, spans=None):
    """Causal attention in float64 over each sequence's gathered context; with a window,
    a query at position p sees keys p - window + 1 .. p; with sinks, each head's sink
    logit joins its softmax (and its weight is dropped), as transformers' gpt-oss does;
    with ``spans``, a query inside one sees on to its end (Gemma 3's images)."""
    seen = None if spans is None else visible(seqs, spans).to(q.device)
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    group = q.shape[1] // k_cache.shape[1]
    block_size = k_cache.shape[2]
    out, start = [], 0
    for s, (context_len, query_len) in enumerate(seqs):
        pos = torch.arange(context_len, device=q.device)
        blocks = block_tables[s, pos // block_size].long()
        k = k_cache[blocks, :, pos % block_size].repeat_interleave(group, dim=1)
        v = v_cache[blocks, :, pos % block_size].repeat_interleave(group, dim=1)
        qs = q[start:start + query_len]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = context_len - query_len + torch.arange(query_len, device=q.device)
        last = q_pos if seen is None else torch.maximum(q_pos, seen[start:start + query_len])
        scores.masked_fill_(pos[None, None, :] > last[None, :, None], -math.inf)
        if window:
            scores.masked_fill_(pos[None, None, :] <= q_pos[None, :, None] - window, -math.inf)
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, query_len, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, v))
        start += query_len
    return torch.cat(out)


def make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Random q (a view of fused qkv), random caches, blocks scattered at random."""
    needed = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max(needed), dtype=torch.int32)
    used = 0
    for s, n in enumerate(needed):
        block_tables[s, :n] = pool[used:used + n]
        used += n
    query_lens = torch.tensor([ql for _, ql in seqs])
    attn = AttnMetadata(
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=DEVICE),
        query_start=torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
        .to(torch.int32).to(DEVICE),
        max_query_len=int(query_lens.max()),
        max_context_len=max(ctx for ctx, _ in seqs),
    )

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    qkv = rand(int(query_lens.sum()), num_heads + 2 * num_kv_heads, head_dim)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return qkv[:, :num_heads], rand(*cache_shape), rand(*cache_shape), attn


def check(request, backend_name, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype,
          cache_dtype=None, window=None, sinks=False, softcap=None, values_are_keys=False,
          spans=None):
    backend = REGISTRY.create("attention", backend_name)
    if not backend.supports(DEVICE):
        pytest.skip(f"{backend_name} does not run on {DEVICE.type}")
    if dtype == torch.bfloat16 and INTERPRETED and backend_name.startswith("triton"):
        # The interpreter keeps bf16 as uint16 and tl.dot multiplies the raw bits
        # (triton-lang/triton#11584, "not supported yet"); compiled kernels are fine.
        pytest.skip("bf16 tl.dot is unsupported by the Triton interpreter")
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))
    q, k_cache, v_cache, attn = make_batch(
        gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    if values_are_keys:  # latent attention's cache (layers/mla.py): one tensor for both
        v_cache = k_cache
    scale = head_dim ** -0.5
    extra = {"window": window} if window else {}
    if sinks:  # logits about as large as the scores, so the sinks take a real share
        extra["sinks"] = (torch.randn(num_heads, generator=gen) * 2).float().to(DEVICE)
    if softcap:
        extra["softcap"] = softcap
    if spans is not None:
        attn.visible = visible(seqs, spans).to(DEVICE, torch.int32)
    out = backend.forward(q, k_cache, v_cache, attn, scale, **extra)
    ref = reference(q, k_cache, v_cache, attn.block_tables, seqs, scale, window,
                    extra.get("sinks"), softcap, spans)
    assert out.shape == q.shape and out.dtype == dtype
    err = (out.double() - ref).norm() / ref.norm()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (4, 4)], ids=["h6kv2", "h9kv3", "h4kv4"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fp32(request, backend_name, batch, heads, head_dim, block_size):
    check(request, backend_name, BATCHES[batch], *heads, head_dim, block_size, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_half_precision(request, backend_name, batch, dtype):
    check(request, backend_name, BATCHES[batch], 6, 2, 64, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("batch", ["decode", "mixed", "prefill_prefix", "long_decode"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_an_fp8_cache(request, backend_name, batch, dtype):
    """kv_cache_dtype fp8: the same attention over the cache's e4m3 values (the
    reference reads them too), in the query's dtype."""
    seqs = LONG_DECODE if batch == "long_decode" else BATCHES[batch]
    check(request, backend_name, seqs, 6, 2, 64, 16, dtype, torch.float8_e4m3fn)


@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("batch", [*BATCHES, "long_decode"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_sliding_window(request, backend_name, batch, window):
    """Windows narrower than a q-block's queries (whose rows then start at different
    keys), than a block, and than the long contexts (split over programs)."""
    seqs = LONG_DECODE if batch == "long_decode" else BATCHES[batch]
    check(request, backend_name, seqs, 6, 2, 24, 4, torch.float32, window=window)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("batch", [*BATCHES, "long_decode"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_attention_sinks(request, backend_name, batch, dtype, window):
    """gpt-oss's sinks, alone and with its 128-token windows' kind (5 here); long decode
    splits its context, and only the first split may count the sink."""
    seqs = LONG_DECODE if batch == "long_decode" else BATCHES[batch]
    check(request, backend_name, seqs, 6, 2, 64, 16, dtype, window=window, sinks=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("batch", [*BATCHES, "long_decode"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_soft_cap(request, backend_name, batch, dtype):
    """Gemma 2's cap of 50 on scores, with its 4,096-token windows' kind (5 here); 1.5
    here, below the random scores' spread, so the cap changes every row."""
    seqs = LONG_DECODE if batch == "long_decode" else BATCHES[batch]
    check(request, backend_name, seqs, 6, 2, 64, 16, dtype, window=5, softcap=1.5)


# Image tokens attending both ways (Gemma 3), [start, end) per sequence of BATCHES' own:
# inside a chunk after a cached prefix, a whole prompt's, two in a 40-token chunk (across
# q-blocks), beside decode rows
SPANS = {"prefill_prefix": [[(8, 11)], [(2, 6)], [(31, 40), (50, 66)]],
         "mixed": [[], [(40, 44)], [], [(3, 20)], []]}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", list(SPANS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_image_tokens_attending_both_ways(request, backend_name, batch, window):
    """Each image token of a prompt chunk sees its whole image (AttnMetadata.visible),
    the others causally; with Gemma 3's window layers' kind (5 here) as well."""
    check(request, backend_name, BATCHES[batch], 6, 2, 24, 4, torch.float32, window=window,
          spans=SPANS[batch])


# (query heads, RoPE dims, latent dims): odd sizes, and DeepSeek's where kernels are compiled
LATENT_SHAPES = [(4, 8, 32), (20, 16, 64)] + ([(16, 64, 512), (128, 64, 512)] if CUDA else [])


@pytest.mark.parametrize("cache", [None, torch.float8_e4m3fn], ids=["cache-as-q", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", LATENT_SHAPES, ids=lambda s: "h{}-{}+{}".format(*s))
@pytest.mark.parametrize("batch", [*BATCHES, "long_decode"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_latent_rows_are_keys_and_values(request, backend_name, batch, shape, dtype, cache):
    """DeepSeek's absorbed latent attention: one KV head whose cache rows, [RoPE | latent],
    are its keys and its values (one tensor); many query heads share it. Over an FP8
    cache, the same attention over its e4m3 values."""
    seqs = LONG_DECODE if batch == "long_decode" else BATCHES[batch]
    heads, rope, latent = shape
    check(request, backend_name, seqs, heads, 1, rope + latent, 16, dtype, cache,
          values_are_keys=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_long_decode(request, backend_name, dtype):
    check(request, backend_name, LONG_DECODE, 6, 2, 64, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (4, 4), (16, 2)], ids=["h6kv2", "h9kv3", "h4kv4", "h16kv2"])
@pytest.mark.parametrize("seqs", [BATCHES["decode"], LONG_DECODE], ids=["short", "long"])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_decode_on_tensor_cores(request, monkeypatch, seqs, heads, dtype, head_dim):
    """triton_paged's other decode tile (tensor-core dots over the padded group)."""
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    monkeypatch.setattr(triton_paged, "DECODE_TUNING", {})
    monkeypatch.setitem(triton_paged.TUNING, "decode", {
        "block_n": 32, "num_warps": 4, "num_stages": 3, "dot": True, "programs_per_sm": 8})
    check(request, "triton_paged", seqs, *heads, head_dim, 16, dtype)


def test_decode_on_tensor_cores_reads_an_fp8_cache(request, monkeypatch):
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    monkeypatch.setattr(triton_paged, "DECODE_TUNING", {})
    monkeypatch.setitem(triton_paged.TUNING, "decode", {
        "block_n": 32, "num_warps": 4, "num_stages": 3, "dot": True, "programs_per_sm": 8})
    check(request, "triton_paged", LONG_DECODE, 16, 2, 64, 16, torch.float16,
          torch.float8_e4m3fn)


def test_long_decode_is_split():
    """The long decode case above really takes triton_paged's split-K path."""
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    pytest.importorskip("triton")
    attn = AttnMetadata(
        block_tables=torch.zeros(len(LONG_DECODE), 1, dtype=torch.int32),
        context_lens=torch.tensor([ctx for ctx, _ in LONG_DECODE], dtype=torch.int32),
        query_start=torch.arange(len(LONG_DECODE) + 1, dtype=torch.int32),
        max_query_len=1,
        max_context_len=max(ctx for ctx, _ in LONG_DECODE),
    )
    tune = triton_paged.decode_tuning(64, 3)
    assert triton_paged.num_splits(attn, 2, triton_paged._num_sms(DEVICE), tune) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("most", [64, 1])
def test_one_long_sequence_split_many_ways_or_none(request, monkeypatch, most, dtype):
    """One sequence on a 132-SM GPU, as a long-context decode at batch 1 runs: its context
    split 64 ways (the most a tile allows) and merged, or not split at all, equals the
    reference."""
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    pytest.importorskip("triton")
    tune = {"block_n": 16, "num_warps": 4, "num_stages": 2, "dot": True, "programs_per_sm": 4,
            "max_splits": most}
    monkeypatch.setattr(triton_paged, "DECODE_TUNING", {})
    monkeypatch.setitem(triton_paged.TUNING, "decode", tune)
    monkeypatch.setattr(triton_paged, "MIN_SPLIT_LEN", 16)  # 64 splits of 1,100 keys
    monkeypatch.setattr(triton_paged, "_num_sms", lambda device: 132)
    seqs = [(1100, 1)]
    attn = make_batch(torch.Generator().manual_seed(0), seqs, 6, 2, 64, 16, dtype)[3]
    assert triton_paged.num_splits(attn, 2, 132, tune) == most
    check(request, "triton_paged", seqs, 6, 2, 64, 16, dtype)


def test_merge_reads_only_the_splits_that_hold_keys():
    """A graph captured for a long bound splits a short context into mostly empty pieces,
    which leave their accumulators unwritten: the merge weighs the others alone, even
    where the empty ones' memory holds NaN."""
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    if not triton_paged.TritonPagedAttention().supports(DEVICE):
        pytest.skip(f"triton_paged does not run on {DEVICE.type}")
    g = torch.Generator().manual_seed(0)
    splits, n, heads, dim, held = 16, 2, 4, 64, 3
    acc = torch.randn(splits, n, heads, dim, generator=g)
    m = torch.randn(splits, n, heads, generator=g)
    l = torch.rand(splits, n, heads, generator=g) + 0.5
    acc[held:], m[held:], l[held:] = float("nan"), float("-inf"), 0.0
    w = torch.exp2(m[:held] - m[:held].amax(0))
    want = (acc[:held] * w[..., None]).sum(0) / (l[:held] * w).sum(0)[..., None]
    out = torch.empty(n, heads, dim, device=DEVICE)
    triton_paged._merge(out, acc.to(DEVICE), m.to(DEVICE), l.to(DEVICE), False)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="compiled kernels: the larger prefill tiles are for GPUs")
@pytest.mark.parametrize("head_dim", [128, 256])
def test_long_prefill_steps(request, head_dim):
    """Steps of at least LONG_PREFILL tokens, which take the larger tiles where the GPU's
    shared memory holds them (triton_paged.prefill_tuning): a chunk after a cached prefix
    and a whole prompt."""
    check(request, "triton_paged", [(5000, 2100), (300, 300)], 8, 2, head_dim, 16,
          torch.bfloat16)


def test_decode_reads_every_fp8_value_exactly(monkeypatch):
    """Each sequence has one key, so its output is that key's V row: every finite e4m3
    value (subnormals, both signs, 448) comes out of the tensor-core decode over an FP8
    cache exactly."""
    triton_paged = pytest.importorskip("roseinfer.plugins.attention.triton_paged")
    monkeypatch.setattr(triton_paged, "DECODE_TUNING", {})
    monkeypatch.setitem(triton_paged.TUNING, "decode", {
        "block_n": 32, "num_warps": 4, "num_stages": 3, "dot": True, "programs_per_sm": 8})
    backend = REGISTRY.create("attention", "triton_paged")
    if not backend.supports(DEVICE):
        pytest.skip(f"triton_paged does not run on {DEVICE.type}")
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    values = torch.cat([bits, bits[:2]]).view(torch.float8_e4m3fn).view(4, 1, 1, 64)
    seqs, heads = 4, 4
    attn = AttnMetadata(torch.arange(seqs, dtype=torch.int32).view(seqs, 1).to(DEVICE),
                        torch.ones(seqs, dtype=torch.int32, device=DEVICE),
                        torch.arange(seqs + 1, dtype=torch.int32, device=DEVICE), 1, 1)
    v_cache = values.to(DEVICE)
    q = torch.randn(seqs, heads, 64, dtype=torch.float16, device=DEVICE)
    out = backend.forward(q, torch.zeros_like(v_cache), v_cache, attn, 0.125)
    want = values.to(torch.float16).view(seqs, 1, 64).expand(-1, heads, -1).to(DEVICE)
    assert torch.equal(out, want)
