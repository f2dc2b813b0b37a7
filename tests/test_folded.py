"""The ops folded into the skinny linear's launch (layers/folded.py) against the unfused
launches they replace: SwiGLU's and GeGLU's act(gate) * up read by down_proj, the residual
add in a linear's epilogue, and the RMSNorm after it applied by the next linear as it
reads. Interpreted on the CPU (float32, float16), compiled on a GPU (bfloat16 too); then
whole models, whose tokens must not move."""
import os

import pytest
import torch
import torch.nn.functional as F

from roseinfer.layers import folded
from roseinfer.layers.fused import add_rms_norm, gelu_tanh_and_mul, silu_and_mul
from roseinfer.layers.skinny_linear import MAX_ROWS, PendingNorm, SummedRows, skinny_linear

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
# The interpreter truncates float32 -> bfloat16 instead of rounding: bf16 compiled only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
rows_ = pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
# (out, in): a K not a multiple of the kernel's K block, and one that is
SHAPES = [(40, 72), (96, 256)] + ([(4096, 14336)] if CUDA else [])


def rand(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@dtypes
@rows_
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_down_reads_the_gated_rows_as_the_unfused_pair_makes_them(gelu, shape, rows, dtype):
    gen = torch.Generator().manual_seed(rows + shape[1] + gelu)
    n, k = shape
    gate_up = rand(gen, rows, 2 * k, dtype=dtype)
    w = rand(gen, n, k, dtype=dtype, scale=k ** -0.5)
    b = rand(gen, n, dtype=dtype)
    act = gelu_tanh_and_mul if gelu else silu_and_mul
    got = skinny_linear(gate_up, w, b, gated=folded.GELU_TANH if gelu else folded.SILU)
    # the same kernel over the rows the activation's own launch stores: the same bits
    assert torch.equal(got, skinny_linear(act(gate_up, use_triton=True), w, b))


@dtypes
@rows_
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_epilogue_adds_the_residual_and_leaves_each_rows_squares(shape, rows, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    n, k = shape
    x, w = rand(gen, rows, k, dtype=dtype), rand(gen, n, k, dtype=dtype, scale=k ** -0.5)
    b, residual = rand(gen, n, dtype=dtype), rand(gen, rows, n, dtype=dtype)
    got = skinny_linear(x, w, b, residual=residual)
    assert isinstance(got, SummedRows)
    # the add as the norm after an unfused linear makes it, bit for bit
    want = add_rms_norm(skinny_linear(x, w, b), residual, torch.ones(n, dtype=dtype).to(DEVICE),
                        1e-6, use_triton=True)[1]
    assert torch.equal(got.rows, want)
    squares = want.double().pow(2).sum(-1)
    torch.testing.assert_close(got.squares.double().sum(0), squares, rtol=1e-5, atol=0)


@dtypes
@rows_
@pytest.mark.parametrize("width", [72, 256] + ([4096] if CUDA else []))
def test_the_next_linear_norms_its_rows_as_the_norm_launch_does(width, rows, dtype):
    gen = torch.Generator().manual_seed(rows + width)
    x, w = rand(gen, rows, 64, dtype=dtype), rand(gen, width, 64, dtype=dtype, scale=0.125)
    summed = skinny_linear(x, w, None, residual=rand(gen, rows, width, dtype=dtype))
    norm_w, eps = rand(gen, width, dtype=dtype), 1e-5
    w2, b2 = rand(gen, 48, width, dtype=dtype, scale=width ** -0.5), rand(gen, 48, dtype=dtype)
    got = skinny_linear(PendingNorm(summed, norm_w, eps), w2, b2)
    normed = add_rms_norm(summed.rows, None, norm_w, eps, use_triton=True)[0]
    want = skinny_linear(normed, w2, b2)
    if dtype == torch.float32:  # only the sum of squares' order differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # ... which moves a normed value across a rounding boundary now and then
        tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_norm_left_pending_only_for_a_linear_that_runs_the_kernel_on_one_row(monkeypatch):
    from torch import nn

    from roseinfer.layers.norm import RMSNorm
    from roseinfer.layers.skinny_linear import SkinnyLinear

    monkeypatch.setenv("ROSEINFER_FOLDS", "1")
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(72, 1e-6).to(DEVICE)
    skinny, plain = nn.Linear(72, 40).to(DEVICE), nn.Linear(72, 40).to(DEVICE)
    skinny.__class__, skinny.max_rows = SkinnyLinear, MAX_ROWS  # as use_skinny_linears makes it
    w = rand(gen, 72, 64, dtype=torch.float32)
    for rows in (1, 2):
        summed = skinny_linear(rand(gen, rows, 64, dtype=torch.float32), w, None,
                               residual=rand(gen, rows, 72, dtype=torch.float32))
        stale = torch.full_like(summed.rows, 1e3)  # a SummedRows holds its residual already
        for into in (skinny, plain, None):
            h, residual = norm(summed, stale, into=into)
            assert residual is summed.rows
            assert isinstance(h, PendingNorm) == (into is skinny and rows == 1)
            torch.testing.assert_close(skinny(h), F.linear(norm(summed.rows)[0], skinny.weight,
                                                           skinny.bias), rtol=1e-5, atol=1e-5)


def folded_calls(monkeypatch) -> list:
    """Spy on every skinny launch: (gated, pending norm, residual) each."""
    from roseinfer.layers import skinny_linear as skinny

    monkeypatch.setenv("ROSEINFER_FOLDS", "1")
    calls, launch = [], skinny.skinny_linear

    def spy(x, weight, bias=None, **kw):
        calls.append((kw.get("gated", 0), isinstance(x, PendingNorm),
                      kw.get("residual") is not None))
        return launch(x, weight, bias, **kw)

    monkeypatch.setattr(folded, "skinny_linear", spy)
    monkeypatch.setattr(skinny, "skinny_linear", spy)
    return calls


def skinny_everywhere(monkeypatch):
    """Every half- and full-precision linear on the skinny kernel up to 16 rows, on the CPU
    too (interpreted): as the loader makes them on a Hopper GPU where the kernel wins."""
    from roseinfer.layers import skinny_linear as skinny
    from roseinfer.models import loader

    monkeypatch.setattr(loader, "measured_on", lambda device: True)
    monkeypatch.setattr(loader, "triton_usable", lambda device: True)
    monkeypatch.setattr(skinny, "skinny_rows", lambda linears: MAX_ROWS)
    original = skinny.use_skinny_linears

    def every_dtype(model, rows_faster=None):  # float32 on the CPU: the suite's references
        for m in model.modules():
            if type(m) is torch.nn.Linear and m.weight.is_contiguous():
                m.__class__, m.max_rows = skinny.SkinnyLinear, MAX_ROWS
        original(model, rows_faster)

    monkeypatch.setattr(loader, "use_skinny_linears", every_dtype)


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
def test_a_model_with_every_fold_generates_what_transformers_does(family, monkeypatch):
    from roseinfer import LLM, SamplingParams
    from tests.models import tiny_family, tiny_llama

    hf = tiny_llama() if family == "llama" else tiny_family(family)
    prompts = [[5, 17, 99, 3, 8, 21], [200, 1, 42], [7] * 9]
    max_tokens = 6
    want = [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    skinny_everywhere(monkeypatch)
    calls = folded_calls(monkeypatch)
    rotated = rope_in_the_append(monkeypatch)
    with LLM(hf, device=DEVICE, dtype="float32", num_kv_blocks=64, cuda_graphs=False,
             kv_append_backend="triton_identity_pos") as llm:
        # one at a time: the folds run at one row (a decode step of one sequence)
        got = [llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))[0].token_ids
               for p in prompts]
    assert got == want
    assert rotated  # decode steps (rows = slots) turned k in the append's launch
    folds = set(calls) - {(0, False, False)}  # the plain products
    add, pending = (0, False, True), (0, True, False)
    if family == "gemma3_text":  # post-norms come between each linear and its add
        assert folds == {(folded.GELU_TANH, False, False)}
    elif family == "qwen2_moe":  # layer 0's MLP is experts and a shared one; layer 1 dense
        assert folds == {add, pending, (folded.SILU, False, True), (folded.SILU, False, False)}
    else:  # o adds the stream; gate_up and the next layer's qkv norm; down gates and adds
        assert folds == {add, pending, (folded.SILU, False, True)}


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


def test_the_folds_run_only_when_asked(monkeypatch):
    """Off by default (measured slower on the H100, docs/kernels.md); ROSEINFER_FOLDS=1
    turns them on."""
    from torch import nn

    from roseinfer.layers.skinny_linear import SkinnyLinear

    linear = nn.Linear(64, 32).to(DEVICE)
    linear.__class__ = SkinnyLinear
    x = torch.zeros(1, 64, device=DEVICE)
    monkeypatch.delenv("ROSEINFER_FOLDS", raising=False)
    assert not folded.folds_into(linear, x)
    monkeypatch.setenv("ROSEINFER_FOLDS", "1")
    assert folded.folds_into(linear, x)
    assert not folded.folds_into(linear, torch.zeros(2, 64, device=DEVICE))
