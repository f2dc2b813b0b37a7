"""Fused elementwise ops: the Triton path against the torch path and an independent reference.

The references are what the unfused models compute: torch's layer_norm,
transformers' LlamaRMSNorm and apply_rotary_pos_emb, silu(gate) * up. Off
CUDA the Triton path runs interpreted on tiny shapes; on a GPU it runs
compiled and the shapes grow.
"""
import zlib

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
# Phi-3's rotates the first cos.shape[-1] dims (partial rotary) and equals Llama's at full width.
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from roseinfer.layers.fused import ROPE_HEAD_ROWS, HeadNorms, add_layer_norm, add_rms_norm, apply_rope, \
    gated_rms_norm, gelu_tanh_and_mul, silu_and_mul

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROWS = 300 if CUDA else 5
HIDDEN = [72, 576] + ([4096] if CUDA else [])
INTERMEDIATE = [72, 1536] + ([14336] if CUDA else [])
# The interpreter truncates float32 -> bfloat16 casts instead of rounding to
# nearest, so bf16 is checked compiled only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# float32 differs by summation order and rsqrt rounding only; half types by
# an output rounded to the neighbouring value.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6),
       torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}
EPS = 1e-5
MAX_POS = 64 if not CUDA else 4096
H, HKV = 6, 2  # GQA: 3 query heads per KV head

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture
def gen(request):
    """A generator seeded by the test id: fresh inputs per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def assert_close(actual, expected, dtype):
    """Close within TOL and, for half types, bit-equal almost everywhere.

    Both sides round one float32 value per element, so only values within
    float32 noise of a rounding boundary may differ; a different rounding order
    (e.g. LlamaRMSNorm's intermediate cast skipped) changes far more of them.
    """
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    if dtype != torch.float32:
        assert (actual != expected).float().mean().item() <= 0.01


def norm_cases(test):
    """Every dtype and hidden size, with and without a residual to add."""
    test = pytest.mark.parametrize("hidden", HIDDEN)(test)
    test = pytest.mark.parametrize("with_residual", [True, False],
                                   ids=["residual", "no_residual"])(test)
    return dtypes(test)


def norm_inputs(gen, hidden, with_residual, dtype):
    """(x, residual or None, what the norm sees: x + residual or x)."""
    x = randn(gen, ROWS, hidden, dtype=dtype)
    residual = randn(gen, ROWS, hidden, dtype=dtype) if with_residual else None
    return x, residual, x + residual if with_residual else x


@norm_cases
def test_add_layer_norm(gen, hidden, with_residual, dtype):
    x, residual, summed = norm_inputs(gen, hidden, with_residual, dtype)
    weight, bias = 1 + 0.2 * randn(gen, hidden, dtype=dtype), randn(gen, hidden, dtype=dtype)
    expected = F.layer_norm(summed.float(), (hidden,), weight.float(), bias.float(), EPS).to(dtype)

    for use_triton in (True, False):
        normed, residual_out = add_layer_norm(x, residual, weight, bias, EPS, use_triton=use_triton)
        assert torch.equal(residual_out, summed)
        assert_close(normed, expected, dtype)


@norm_cases
def test_add_rms_norm(gen, hidden, with_residual, dtype):
    x, residual, summed = norm_inputs(gen, hidden, with_residual, dtype)
    hf_norm = LlamaRMSNorm(hidden, eps=EPS).to(DEVICE, dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.2 * randn(gen, hidden, dtype=dtype))
        expected = hf_norm(summed)

    for use_triton in (True, False):
        normed, residual_out = add_rms_norm(x, residual, hf_norm.weight.detach(), EPS,
                                            use_triton=use_triton)
        assert torch.equal(residual_out, summed)
        assert_close(normed, expected, dtype)


@dtypes
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gemma_rms_norm(gen, with_residual, dtype):
    """Scaled by 1 + weight in float32 and rounded once, as transformers' Gemma3RMSNorm."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hidden = 72
    x, residual, summed = norm_inputs(gen, hidden, with_residual, dtype)
    hf_norm = Gemma3RMSNorm(hidden, eps=EPS).to(DEVICE, dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(0.2 * randn(gen, hidden, dtype=dtype))
        expected = hf_norm(summed)
    for use_triton in (True, False):
        normed, residual_out = add_rms_norm(x, residual, hf_norm.weight.detach(), EPS,
                                            use_triton=use_triton, unit_offset=True)
        assert torch.equal(residual_out, summed)
        assert_close(normed, expected, dtype)


@dtypes
def test_gemma_post_norm_then_add_then_norm(gen, dtype):
    """A block's output through its post-norm, added to the residual stream, then the next
    norm: Gemma's three steps in one kernel, against transformers' two norms and the add."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hidden = 72
    block, residual, _ = norm_inputs(gen, hidden, True, dtype)
    post, pre = (Gemma3RMSNorm(hidden, eps=EPS).to(DEVICE, dtype) for _ in range(2))
    with torch.no_grad():
        for norm in (post, pre):
            norm.weight.copy_(0.2 * randn(gen, hidden, dtype=dtype))
        summed = post(block) + residual
        expected = pre(summed)
    for use_triton in (True, False):
        normed, residual_out = add_rms_norm(block, residual, pre.weight.detach(), EPS,
                                            use_triton=use_triton, unit_offset=True,
                                            x_weight=post.weight.detach())
        assert_close(residual_out, summed, dtype)
        assert_close(normed, expected, dtype)


@dtypes
@pytest.mark.parametrize("intermediate", INTERMEDIATE)
def test_gelu_tanh_and_mul(gen, intermediate, dtype):
    """Close, not bit-equal: the kernel's x * sigmoid(2u) and torch's 0.5 x (1 + tanh(u))
    round apart where tanh(u) nears -1 (4 % of float16 values)."""
    gate_up = 3 * randn(gen, ROWS, 2 * intermediate, dtype=dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") * up).to(dtype)
    assert_close(gelu_tanh_and_mul(gate_up, use_triton=False), expected, dtype)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up, use_triton=True), expected,
                               **TOL[dtype])


@dtypes
@pytest.mark.parametrize("lead", [(ROWS,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("intermediate", INTERMEDIATE)
def test_silu_and_mul(gen, intermediate, lead, dtype):
    gate_up = 3 * randn(gen, *lead, 2 * intermediate, dtype=dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(dtype)

    for use_triton in (True, False):
        assert_close(silu_and_mul(gate_up, use_triton=use_triton), expected, dtype)


def rope_tables(dim):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def rope_reference(x, heads, positions, cos, sin):
    """transformers' apply_rotary_pos_emb on [1, heads, N, D] with full-width cos/sin."""
    per_head = x.float().view(x.shape[0], heads, -1).transpose(0, 1).unsqueeze(0)
    cos = torch.cat([cos[positions]] * 2, dim=-1).unsqueeze(0)
    sin = torch.cat([sin[positions]] * 2, dim=-1).unsqueeze(0)
    rotated, _ = apply_rotary_pos_emb(per_head, per_head, cos, sin)
    return rotated[0].transpose(0, 1).reshape(x.shape).to(x.dtype)


@dtypes
@pytest.mark.parametrize("fused", [True, False], ids=["qkv_view", "contiguous"])
@pytest.mark.parametrize("head_dim,rotary", [(12, 12), (64, 64), (64, 32), (96, 72)],
                         ids=["d12", "d64", "d64-partial32", "d96-partial72"])
def test_apply_rope(gen, head_dim, rotary, fused, dtype):
    """In place on q and k, which may be column slices of a fused qkv tensor; v untouched.
    Partial rotary: only each head's first ``rotary`` dims turn."""
    q_size, kv_size = H * head_dim, HKV * head_dim
    qkv = randn(gen, ROWS, q_size + 2 * kv_size, dtype=dtype)
    # Unsorted positions; int32 as the engine packs them, int64 as indexing produces them.
    positions = torch.randperm(MAX_POS, generator=gen)[:ROWS].to(
        torch.int32 if fused else torch.int64).to(DEVICE)
    cos, sin = rope_tables(rotary)
    expected_q = rope_reference(qkv[:, :q_size], H, positions, cos, sin)
    expected_k = rope_reference(qkv[:, q_size:q_size + kv_size], HKV, positions, cos, sin)

    for use_triton in (True, False):
        work = qkv.clone()
        q, k = work[:, :q_size], work[:, q_size:q_size + kv_size]
        if not fused:
            q, k = q.contiguous(), k.contiguous()
        q_out, k_out = apply_rope(q, k, positions, cos, sin, H, HKV, use_triton=use_triton)
        assert q_out is q and k_out is k
        assert_close(q, expected_q, dtype)
        assert_close(k, expected_k, dtype)
        assert torch.equal(work[:, q_size + kv_size:], qkv[:, q_size + kv_size:])


@dtypes
@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Gemma3RMSNorm], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("rows", [5, ROPE_HEAD_ROWS + 4], ids=["head-programs", "token-programs"])
def test_apply_rope_with_head_norms(gen, norm_class, rows, dtype):
    """Qwen3's and Gemma 3's q/k norms folded into the RoPE kernel: each head normed by
    transformers' norm (Qwen3's is LlamaRMSNorm), then rotated; the fused kernel and the
    unfused torch path agree with that and with each other, with a program per head (few
    tokens) and per token's q or k."""
    head_dim = 16
    q_size, kv_size = H * head_dim, HKV * head_dim
    qkv = randn(gen, rows, q_size + 2 * kv_size, dtype=dtype)
    positions = torch.randperm(MAX_POS, generator=gen)[:rows].to(torch.int32).to(DEVICE)
    cos, sin = rope_tables(head_dim)
    refs = []
    for _ in range(2):
        norm = norm_class(head_dim, eps=EPS).to(DEVICE)
        norm.weight.data = randn(gen, head_dim, dtype=dtype)
        refs.append(norm)
    norms = HeadNorms(refs[0].weight.data, refs[1].weight.data, EPS,
                      unit_offset=norm_class is Gemma3RMSNorm)

    def normed(x, norm):
        with torch.no_grad():
            return norm(x.reshape(-1, head_dim)).reshape(x.shape)

    expected_q = rope_reference(normed(qkv[:, :q_size], refs[0]), H, positions, cos, sin)
    expected_k = rope_reference(normed(qkv[:, q_size:q_size + kv_size], refs[1]), HKV,
                                positions, cos, sin)
    results = []
    for use_triton in (True, False):
        work = qkv.clone()
        q, k = work[:, :q_size], work[:, q_size:q_size + kv_size]
        q, k = apply_rope(q, k, positions, cos, sin, H, HKV, use_triton=use_triton, norms=norms)
        assert_close(q, expected_q, dtype)
        assert_close(k, expected_k, dtype)
        assert torch.equal(work[:, q_size + kv_size:], qkv[:, q_size + kv_size:])
        results.append((q, k))
    (fused_q, fused_k), (plain_q, plain_k) = results
    assert_close(fused_q, plain_q, dtype)
    assert_close(fused_k, plain_k, dtype)


@dtypes
@pytest.mark.parametrize("family", ["qwen3_next", "granite"])
def test_gated_rms_norm(gen, family, dtype):
    """Against transformers' own gated norms: Qwen3-Next's per value head (norm, weight,
    then the gate) and Granite 4.0-H's Mamba2 one over groups (the gate first); the gate
    read through a row stride, as the layers' split views give it."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import \
        GraniteMoeHybridRMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    if family == "qwen3_next":  # [tokens, value heads, value dim], the weight a head's
        x, width, group = randn(gen, ROWS, 4, 48, dtype=dtype), 48, 48
        hf = Qwen3NextRMSNormGated(48, eps=EPS)
    else:  # [tokens, inner] in 4 groups
        x, width, group = randn(gen, ROWS, 192, dtype=dtype), 192, 48
        hf = GraniteMoeHybridRMSNormGated(192, 48, eps=EPS)
    gate = randn(gen, *x.shape[:-1], width + 16, dtype=dtype)[..., 16:]
    hf = hf.to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * randn(gen, width, dtype=dtype))
        expected = hf(x, gate)
    for use_triton in (True, False):
        got = gated_rms_norm(x, gate, hf.weight.detach(), EPS, group,
                             gate_first=family == "granite", use_triton=use_triton)
        assert got.shape == x.shape
        assert_close(got, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    """All four ops capture into one graph and replay on new inputs written in place."""
    gen = torch.Generator().manual_seed(0)
    rows, hidden, inter, head_dim, dtype = 128, 576, 1536, 64, torch.float16
    q_size, kv_size = H * head_dim, HKV * head_dim
    x, residual = randn(gen, rows, hidden, dtype=dtype), randn(gen, rows, hidden, dtype=dtype)
    weight, bias = randn(gen, hidden, dtype=dtype), randn(gen, hidden, dtype=dtype)
    gate_up = randn(gen, rows, 2 * inter, dtype=dtype)
    qkv = randn(gen, rows, q_size + 2 * kv_size, dtype=dtype)
    positions = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    cos, sin = rope_tables(head_dim)

    def step(use_triton=None):
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        apply_rope(q, k, positions, cos, sin, H, HKV, use_triton=use_triton)
        return (*add_layer_norm(x, residual, weight, bias, EPS, use_triton=use_triton),
                *add_rms_norm(x, residual, weight, EPS, use_triton=use_triton),
                silu_and_mul(gate_up, use_triton=use_triton))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for _ in range(2):
        for t in (x, residual, gate_up, qkv):
            t.copy_(randn(gen, *t.shape, dtype=dtype))
        positions.copy_(torch.randperm(MAX_POS, generator=gen)[:rows])
        qkv_in = qkv.clone()
        graph.replay()
        replayed = (qkv.clone(), *outs)
        qkv.copy_(qkv_in)
        expected = step(use_triton=False)  # rotates qkv in place as well
        for got, want in zip(replayed, (qkv, *expected)):
            assert_close(got, want, dtype)
