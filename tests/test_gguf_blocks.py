"""GGUF blocks multiplied as stored (cpu_weight_dtype="gguf"): the kernels against the
registry's ``gguf`` package de-quantizing the same blocks, three builds (this CPU's, an
AVX2 one without AVX-512 and a portable one without either), and the default model's file
end to end."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import ConfigError
from roseinfer.layers import gguf_repack, gguf_linear
from roseinfer.layers.gguf_linear import GgufLinear, quantize_rows_like_kernel
from roseinfer.models import gguf_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KINDS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
BUILDS = {"portable": ("-O3", "-march=x86-64-v2", *gguf_linear.OPENMP),
          "avx2": ("-O3", "-march=x86-64-v3", *gguf_linear.OPENMP)}


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def ops(request):
    if request.param == "native":
        return gguf_linear.build()
    if request.param == "avx2" and " avx2" not in gguf_linear._cpu():
        pytest.skip("this CPU has no AVX2")
    return gguf_linear.build(BUILDS[request.param], f"roseinfer_gguf_{request.param}")


def quantized(kind, n, k, seed=0):
    """(blocks [n, bytes] uint8, the gguf package's de-quantized float32 [n, k])."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1).numpy()
    raw = gguf.quantize(w.astype(np.float32), kind)
    deq = torch.from_numpy(gguf.dequantize(raw, kind).astype(np.float32)).reshape(n, k)
    return torch.from_numpy(np.array(raw)).view(torch.uint8).reshape(n, -1), deq


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("k", [96, 576])  # 3 blocks a row (an odd last one), and 18
def test_dequantize_equals_the_gguf_package(ops, kind, k):
    blocks, deq = quantized(kind, 40, k)
    assert torch.equal(ops.dequantize(blocks, int(kind), k), deq)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # the kernel takes rows 4 at a time
@pytest.mark.parametrize("k", [96, 576])
def test_block_dots_equal_rounded_rows_times_the_weights(ops, kind, rows, k):
    """The kernel rounds x to int8 per block of 32, then its dots are exact: the product of
    the rounded rows and the de-quantized weight, in float64, up to float32 sums."""
    blocks, deq = quantized(kind, 72, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = quantize_rows_like_kernel(x).double() @ deq.double().T
    got = ops.mm(x, blocks, int(kind))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    # and within the rounding of x of the float product
    exact = x.double() @ deq.double().T
    assert 1e-4 < ((got - exact).norm() / exact.norm()).item() < 2e-2


def stored_blocks(kind, n, k):
    """(rows of ``kind`` blocks, their de-quantized values [n, k]): from the gguf package,
    or for kind 100 a Q4_K tensor repacked; Q8_0's first block of a row holds -128 and 127."""
    if kind == gguf_linear.F32_Q4:
        raw, deq = random_blocks(Q.Q4_K, n, k)
        return torch.from_numpy(gguf_repack.repack(int(Q.Q4_K), raw)[1]), deq
    blocks, deq = quantized(kind, n, k)
    if kind == Q.Q8_0:  # every int8 level, -128 and 127 among them
        levels = torch.randint(-128, 128, (n, 32), generator=torch.Generator().manual_seed(k))
        levels[:, :2] = torch.tensor([-128, 127])
        blocks[:, 2:34] = levels.to(torch.int8).view(torch.uint8)
        deq = torch.from_numpy(gguf.dequantize(blocks.numpy(), kind).astype(np.float32))
    return blocks, deq.reshape(n, k)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, gguf_linear.F32_Q4],
                         ids=lambda k: getattr(k, "name", str(k)))
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("k", [256, 768])
def test_sixteen_interleaved_rows_are_the_same_weights(ops, kind, rows, k):
    """Kinds 102-105 hold Q4_1's, Q8_0's, Q4_0's and kind 100's values in the order the
    SIMD forms read (every build reads them): their de-quantization is the stored kind's,
    bit for bit, and their dots those of the rows as stored."""
    blocks, deq = stored_blocks(kind, 48, k)
    mixed, wide = gguf_linear.interleave(int(kind), blocks), gguf_linear.INTERLEAVED[kind]
    assert mixed.shape == blocks.shape and not torch.equal(mixed, blocks)
    assert torch.equal(ops.dequantize(mixed, wide, k), deq)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(ops.mm(x, mixed, wide), ops.mm(x, blocks, int(kind)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form, kinds", [
    (2, {2: 104, 3: 102, 8: 103}), (1, {2: 104, 3: 102, 8: 8}),  # AVX2 reads Q8_0 as stored
    (0, {2: 2, 3: 3, 8: 8})], ids=["vnni", "avx2", "plain"])
def test_the_linear_interleaves_what_its_build_reads_faster(monkeypatch, form, kinds):
    class Built:
        @staticmethod
        def form():
            return form
    monkeypatch.setattr(gguf_linear, "build", lambda: Built)
    gguf_linear.interleaves.cache_clear()
    try:
        for stored, want in kinds.items():
            blocks, _ = quantized(stored, 32, 96)
            assert GgufLinear(blocks, stored, 96).kind == want
        assert GgufLinear(quantized(Q.Q4_1, 24, 96)[0], 3, 96).kind == 3  # not 16 a group
    finally:
        gguf_linear.interleaves.cache_clear()


def test_each_build_says_its_form(ops, request):
    """The form the preprocessor chose, as the interleaving reads it: this CPU's build
    VNNI or AVX2 where its flags have them; the portable one (x86-64-v2) plain."""
    flags = gguf_linear._cpu()
    want = {"native": 2 if " avx512_vnni" in flags else 1 if " avx2" in flags else 0,
            "avx2": 1, "portable": 0}
    assert ops.form() == want[request.node.callspec.params["ops"]]


def test_bad_blocks_are_refused_by_name():
    ops = gguf_linear.build()
    blocks, _ = quantized(Q.Q4_1, 8, 96)
    with pytest.raises(RuntimeError, match="do not hold 64 weights"):
        ops.mm(torch.randn(1, 64), blocks, int(Q.Q4_1))
    with pytest.raises(RuntimeError, match="is not one of"):
        ops.dequantize(blocks, 12, 96)
    with pytest.raises(RuntimeError, match="groups of 16 rows, not 8"):
        ops.mm(torch.randn(1, 96), blocks, gguf_linear.INTERLEAVED[Q.Q4_1])


def bf16(t):
    return t.bfloat16().float()


@pytest.mark.parametrize("bf16_gemm", [True, False])
@pytest.mark.parametrize("rows", [1, gguf_linear.DOT_ROWS - 1, gguf_linear.DOT_ROWS + 3])
def test_the_linear_uses_the_blocks_or_their_weights(rows, bf16_gemm, monkeypatch):
    """Below DOT_ROWS the integer dots (x rounded per block); from it the de-quantized
    weight through a GEMM: bfloat16 (x and the weight rounded, the output too) where the
    CPU has oneDNN's bfloat16 kernels, else float32 (x as it is)."""
    if bf16_gemm and not gguf_linear.BF16_GEMM:
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU")
    monkeypatch.setattr(gguf_linear, "BF16_GEMM", bf16_gemm)
    gguf_linear.build()
    blocks, deq = quantized(Q.Q4_1, 48, 96)
    bias = torch.randn(48)
    layer = GgufLinear(blocks, int(Q.Q4_1), 96, bias)
    # the rows the linear sees, in a batch's shape; seeded, as the reference rounds x itself
    x = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows))
    if rows < gguf_linear.DOT_ROWS:
        want, tol = F.linear(quantize_rows_like_kernel(x), deq, bias), 1e-5
    elif bf16_gemm:
        want, tol = bf16(F.linear(bf16(x), bf16(deq))) + bias, 1e-2
    else:
        want, tol = F.linear(x, deq, bias), 1e-5
    torch.testing.assert_close(layer(x), want, rtol=tol, atol=tol)
    torch.testing.assert_close(layer(x, gelu="tanh"), F.gelu(want, approximate="tanh"),
                               rtol=tol, atol=tol)


def test_blocks_that_are_not_the_weight_are_refused():
    """The load checks sample rows of each swap against the float weight it replaces."""
    gguf_linear.build()
    blocks, deq = quantized(Q.Q4_1, 48, 96)
    gguf_blocks._check("layers.0.o_proj", deq, blocks, int(Q.Q4_1))  # the same: passes
    with pytest.raises(ConfigError, match="layers.0.o_proj: .* other values"):
        gguf_blocks._check("layers.0.o_proj", deq, blocks.flip(0).contiguous(), int(Q.Q4_1))
    with pytest.raises(ConfigError, match="do not hold its 48 x 64 weight"):
        gguf_blocks._check("layers.0.o_proj", deq[:, :64], blocks, int(Q.Q4_1))


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "How many legs does a spider have?", "Explain gravity in one sentence."]


# Nats between float32's first and second choice. Rounding x to int8 makes a step's
# logits a step function of tiny changes: two builds of the kernels whose products differ
# by float32 sums' order alone (at most 6e-7 of a product) moved first-token log
# probabilities of these prompts by up to 0.19 nats, so a tie is what lies within twice that
NEAR_TIE = 0.4


def greedy(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=48,
                                                                      temperature=0))]


@pytest.fixture(scope="module")
def float32():
    llm = LLM("smollm2", cpu_weight_dtype="float32", cpu_compiled_step="off")
    return llm, greedy(llm)


def assert_equal_up_to_near_ties(ids, float32):
    """Each continuation equals float32's, or leaves it where float32's own first two
    choices are within NEAR_TIE nats and it takes the second: the int8 rounding of the
    activations (about 0.5 % of a product) moves such ties and no other."""
    llm, want = float32
    tokenizer = llm.tokenizer
    for prompt, got, ref in zip(PROMPTS, ids, want):
        if got == ref:
            continue
        j = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        head = tokenizer.encode(prompt) + ref[:j]
        step = llm.generate([head], SamplingParams(max_tokens=1, temperature=0, logprobs=2))
        (first, p1), (second, p2) = step[0].logprobs[0].top[:2]
        assert (first, second) == (ref[j], got[j]) and p1 - p2 < NEAR_TIE, \
            (prompt, j, first, p1, second, p2)


def test_the_default_models_blocks_decode_as_float32(float32):
    """Every linear of the default model's Q4_1 file (and its Q8_0 head) multiplied as
    stored: the greedy continuations equal those of the de-quantized float32 model, up to
    near-ties."""
    llm = LLM("smollm2", cpu_weight_dtype="gguf", cpu_compiled_step="off")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, GgufLinear)]
    assert len(linears) == 30 * 4 + 1  # qkv, o, gate_up and down a layer; the tied head
    assert isinstance(llm.engine.model.head.linear, GgufLinear)
    assert_equal_up_to_near_ties(greedy(llm), float32)


def test_the_compiled_step_calls_the_block_kernels(float32):
    """The compiled CPU step (AOTInductor) calls the kernels through their operator
    library, which the engine and the build's probe load first."""
    llm = LLM("smollm2", cpu_weight_dtype="gguf", cpu_compiled_step="build")
    step = llm.engine.runner.compiled
    if step is None:  # built, but slower than eager on this machine: recorded
        pytest.skip("the compiled step measured slower than the eager one here")
    assert_equal_up_to_near_ties(greedy(llm), float32)


def test_gguf_weights_need_a_gguf_file():
    with pytest.raises(ConfigError, match="cpu_weight_dtype gguf .* is not one"):
        LLM("smollm2-random", cpu_weight_dtype="gguf")


REPACKED = {Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210), Q.Q5_0: (32, 22),
            Q.Q5_1: (32, 24)}  # weights and bytes a block


def random_blocks(kind, n, k, seed=0):
    """(rows of ``kind`` blocks, random but well-formed, [n, bytes] uint8; the gguf
    package's de-quantized float32 [n, k])."""
    rng = np.random.default_rng(seed)
    weights, size = REPACKED[kind]
    nb = n * k // weights
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (nb, 2)).astype(np.float16).view(np.uint8)
    if kind == Q.Q6_K:  # d last
        raw[:, -2:] = scales[:, :2]
    else:  # d, and dmin or m, first
        raw[:, :4] = scales
    raw = raw.reshape(n, -1)
    deq = torch.from_numpy(gguf.dequantize(raw, kind).astype(np.float32)).reshape(n, k)
    return raw, deq


@pytest.mark.parametrize("kind", list(REPACKED), ids=lambda k: k.name)
def test_repacked_kinds_hold_the_same_values(ops, kind):
    """Q4_K, Q5_K and Q6_K super-blocks, and Q5_0 and Q5_1 blocks, become blocks of 32
    with float32 scales: the kernels de-quantize them to exactly the gguf package's
    values, and multiply them as the rounded rows times those values."""
    raw, deq = random_blocks(kind, 24, 512)
    repacked, blocks = gguf_repack.repack(int(kind), raw)
    blocks = torch.from_numpy(blocks)
    assert torch.equal(ops.dequantize(blocks, repacked, 512), deq)
    for rows in (1, 5):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        want = quantize_rows_like_kernel(x).double() @ deq.double().T
        got = ops.mm(x, blocks, repacked)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())


def test_fused_linears_follow_the_family_and_skip_mixed_kinds():
    """The family's own fusing, run on row indexes: gate and up of one kind become
    gate_up's rows in its order; q, k and v of two kinds (llama.cpp's mixes keep v wider)
    stay float."""
    from roseinfer.models.llama import LlamaForCausalLM
    rows = {f"model.layers.0.{name}.weight": torch.randint(0, 256, (n, width),
                                                           dtype=torch.uint8)
            for name, n, width in [("self_attn.q_proj", 8, 20), ("self_attn.k_proj", 4, 20),
                                   ("self_attn.v_proj", 4, 34), ("mlp.gate_proj", 6, 20),
                                   ("mlp.up_proj", 6, 20)]}
    kinds = {hf: 8 if "v_proj" in hf else 3 for hf in rows}
    fused = dict(gguf_blocks._fused(LlamaForCausalLM, None, rows, kinds))
    assert list(fused) == ["layers.0.gate_up_proj.weight"]
    kind, blocks = fused["layers.0.gate_up_proj.weight"]
    gate, up = (rows[f"model.layers.0.mlp.{name}.weight"] for name in ("gate_proj", "up_proj"))
    assert kind == 3 and torch.equal(blocks, torch.cat([gate, up]))
