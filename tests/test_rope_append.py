"""RoPE turned by the KV append's launch (``TritonAppend.append_rotated``, taken where
``RotaryEmbedding.deferred`` hands it a Rotation: CUDA unless ``ROSEINFER_ROPE_IN_APPEND=0``) against
the two launches it replaces, interpreted on the CPU and compiled on a GPU; then whole
models, whose tokens must not move."""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


def rand(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rope_in_the_append(monkeypatch) -> list:
    """RoPE left to the KV append on the CPU too (on CUDA where the kernel runs); returns
    the list of the launches that took it."""
    from roseinfer.layers.rotary import RotaryEmbedding, Rotation
    from roseinfer.plugins.kv_append.triton_append import TritonAppend

    taken, fused = [], TritonAppend.append_rotated

    def deferred(self, positions, q, num_heads, num_kv_heads, norms=None):
        return Rotation(self, positions, num_heads, num_kv_heads, norms)

    def spy(*args):
        done = fused(*args)
        taken.append(done) if done else None
        return done

    monkeypatch.setattr(RotaryEmbedding, "deferred", deferred)
    monkeypatch.setattr(TritonAppend, "append_rotated", spy)
    return taken


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "qwen2_moe"])
def test_a_model_with_rope_in_the_append_generates_what_transformers_does(family, monkeypatch):
    from roseinfer import LLM, SamplingParams
    from tests.models import tiny_family, tiny_llama

    hf = tiny_llama() if family == "llama" else tiny_family(family)
    prompts = [[5, 17, 99, 3, 8, 21], [200, 1, 42], [7] * 9]
    max_tokens = 6
    want = [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    rotated = rope_in_the_append(monkeypatch)
    with LLM(hf, device=DEVICE, dtype="float32", num_kv_blocks=64, cuda_graphs=False,
             kv_append_backend="triton_identity_pos") as llm:
        got = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))
    assert [out.token_ids for out in got] == want
    assert rotated  # decode steps (rows = slots) turned k in the append's launch


@pytest.mark.parametrize("variant", ["identity_pos", "full_batch"])
@pytest.mark.parametrize("rows", [1, 5, 20])  # 20: past ROPE_HEAD_ROWS, a program a token's q
@pytest.mark.parametrize("norms", [False, True], ids=["rope", "qk_norms"])
@pytest.mark.parametrize("cache_dtype", ["same", "fp8"])
def test_rope_and_the_append_in_one_launch_write_what_the_two_launches_write(
        variant, rows, norms, cache_dtype):
    from roseinfer.layers.fused import HeadNorms, apply_rope
    from roseinfer.layers.rotary import RotaryEmbedding, Rotation
    from roseinfer.plugins.kv_append.triton_append import TritonAppend
    from roseinfer.core.kv_cache import SlotBatch

    dtype = torch.float16
    gen = torch.Generator().manual_seed(rows + 10 * norms)
    heads, kv_heads, head_dim, blocks, block_size = 6, 2, 16, 8, 4
    qkv = rand(gen, rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim), 64)
    rotary.build_tables(DEVICE)
    positions = torch.randint(64, (rows,), generator=gen).to(DEVICE)
    head_norms = HeadNorms(rand(gen, head_dim, dtype=dtype), rand(gen, head_dim, dtype=dtype),
                           1e-6) if norms else None
    slot = torch.randperm(blocks * block_size, generator=gen)[:rows]
    if variant == "full_batch":  # one offset, a block a row
        blocks = 3 * blocks
        offset = torch.randint(block_size, (1,), generator=gen).to(torch.int32).to(DEVICE)
        slots = SlotBatch(torch.randperm(blocks, generator=gen)[:rows].to(torch.int32).to(DEVICE),
                          offset.expand(rows), shared_offset=offset)
    else:
        slots = SlotBatch((slot // block_size).to(torch.int32).to(DEVICE),
                          (slot % block_size).to(torch.int32).to(DEVICE))
    fp8 = cache_dtype == "fp8"
    cache_type = torch.float8_e4m3fn if fp8 else dtype
    shape = (blocks + 1, kv_heads, block_size, head_dim)
    poison = torch.randn(shape, generator=gen).to(cache_type).to(DEVICE)
    caches = [poison.clone() for _ in range(4)]  # K and V, fused then two launches
    backend = TritonAppend(variant)
    q_fused, qkv_before = q.clone(), qkv.clone()
    k_alone, v_alone = k.clone(), v.clone()
    rotation = Rotation(rotary, positions, heads, kv_heads, head_norms)
    assert backend.append_rotated(caches[0], caches[1], q_fused, k, v, slots, rotation)
    q2, k2 = apply_rope(q.clone(), k_alone, positions, rotary.cos, rotary.sin, heads, kv_heads,
                        use_triton=True, norms=head_norms)
    backend.append(caches[2], caches[3], k2.view(rows, kv_heads, head_dim),
                   v_alone.view(rows, kv_heads, head_dim), slots)
    assert torch.equal(q_fused, q2)
    as_bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    assert torch.equal(as_bits(caches[0]), as_bits(caches[2]))
    assert torch.equal(as_bits(caches[1]), as_bits(caches[3]))
    assert torch.equal(qkv[:, heads * head_dim:], qkv_before[:, heads * head_dim:])  # k, v kept


def test_rope_waits_for_the_append_unless_turned_off(monkeypatch):
    """On by default where the Triton kernels run (measured to pay on the H100,
    docs/kernels.md); ROSEINFER_ROPE_IN_APPEND=0 turns it off."""
    from roseinfer.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), 64)
    q = torch.zeros(1, 6 * 16, device=DEVICE)
    positions = torch.zeros(1, dtype=torch.long, device=DEVICE)
    monkeypatch.delenv("ROSEINFER_ROPE_IN_APPEND", raising=False)
    assert (rotary.deferred(positions, q, 6, 2) is not None) == q.is_cuda
    monkeypatch.setenv("ROSEINFER_ROPE_IN_APPEND", "0")
    assert rotary.deferred(positions, q, 6, 2) is None
