"""4-bit linears (models/int4_linear.py) against the product with the de-quantized weight
in float64: the skinny kernel and the de-quantizing kernel interpreted on the CPU and
compiled on a GPU, and a whole model on a GPU quantized at load."""
import pytest
import torch

from roseinfer.models.int4_linear import MAX_ROWS, dequantize, dequantize_weight, \
    int4_skinny_linear, pack, quantize, unpack

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (N, K); the interpreter multiplies bfloat16 wrongly (tests/test_attention_backends)
SHAPES = [(40, 128), (100, 256), (33, 384), (64, 1024), (24, 640)] + \
    ([(4096, 4096), (14336, 4096), (4096, 14336)] if CUDA else [])
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]


def weights(n, k, gen):
    """(levels [N, K], float32 scales [N, K / 128]) of a random weight."""
    return quantize(torch.randn(n, k, generator=gen) / k ** 0.5, 128)


def kernel_operands(levels, scale):
    return pack(levels).to(DEVICE), scale.t().contiguous().half().to(DEVICE)


def test_pack_puts_input_16j_plus_r_of_a_group_in_nibble_j_of_word_row_r():
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (8, 256), generator=gen, dtype=torch.int32)
    words = pack(levels)
    assert words.dtype == torch.int32 and words.shape == (32, 8)  # [K / 8, N]
    assert torch.equal(unpack(words), levels)
    for n, k in [(0, 0), (3, 17), (5, 127), (7, 128 + 16 * 7 + 15), (2, 200)]:
        group, j, r = k // 128, k % 128 // 16, k % 16
        assert (int(words[group * 16 + r, n]) >> 4 * j) & 0xF == levels[n, k]


def test_quantize_rounds_each_group_to_its_nearest_level():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=gen)
    levels, scale = quantize(w, 128)
    assert levels.min() >= 0 and levels.max() <= 15
    assert torch.equal(scale, scale.half().float())  # float16 values, as kept on the GPU
    err = (dequantize(levels, scale) - w).abs()
    assert (err <= scale.repeat_interleave(128, 1) / 2 + 1e-6).all()


@pytest.mark.parametrize("variant", ["split", "dot", "gemv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_skinny_kernel_is_the_product_with_the_dequantized_weight(shape, rows, bias, dtype,
                                                                  variant):
    if variant == "gemv" and rows > 1:
        pytest.skip("one row")
    n, k = shape
    gen = torch.Generator().manual_seed(n * k + rows)
    levels, scale = weights(n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = int4_skinny_linear(x.to(DEVICE), *kernel_operands(levels, scale),
                           None if b is None else b.to(DEVICE), variant=variant)
    ref = x.double() @ dequantize(levels, scale).double().t()
    if bias:
        ref += b.double()
    assert y.dtype == dtype and y.shape == (rows, n)
    err = (y.cpu().double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_dequantizing_kernel_writes_the_float_weight(shape):
    n, k = shape
    levels, scale = weights(n, k, torch.Generator().manual_seed(2))
    w = dequantize_weight(*kernel_operands(levels, scale), DTYPES[0])
    assert w.dtype == DTYPES[0]
    assert torch.equal(w.cpu(), dequantize(levels, scale).to(DTYPES[0]))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_model_quantized_at_load_runs_packed_weights_as_the_dequantized_ones(monkeypatch):
    """On a GPU, int4 at load: every linear but the LM head keeps packed weights, and the
    kernels give the tokens the same levels give as float weights (float32, 1e-5 apart)."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.models import int4_linear
    from roseinfer.plugins.quantization import int4
    from tests.models import tiny_llama

    hf = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    initializer_range=0.05)
    prompts = [[5, 9, 13, 2], list(range(20, 60)), [7] * 18]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(hf, device="cuda", dtype="float32", quantization="int4", num_kv_blocks=64) as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, int4_linear.Int4Linear)]
        assert len(linears) == 4 * hf.config.num_hidden_layers  # qkv, o, gate_up, down
        packed = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(int4, "runs_here", lambda device: False)
    with LLM(hf, device="cuda", dtype="float32", quantization="int4", num_kv_blocks=64) as llm:
        floats = [o.token_ids for o in llm.generate(prompts, params)]
    assert packed == floats
