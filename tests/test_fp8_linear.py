"""FP8 linears (layers/fp8_linear.py) against the W8A8 product computed in float64:
the skinny kernel interpreted on the CPU and compiled on a GPU, the _scaled_mm path and
a whole model on a GPU with FP8."""
import pytest
import torch
import torch.nn.functional as F

from roseinfer.layers import fp8_linear
from roseinfer.layers.fp8_linear import MAX_ROWS, fp8_gemm, fp8_skinny_linear, runs_here
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale, fp8_rows

CUDA = torch.cuda.is_available() and runs_here(torch.device("cuda"))
DEVICE = "cuda" if CUDA else "cpu"
SHAPES = [(40, 64), (100, 96), (33, 8), (64, 1024)] + \
    ([(4096, 4096), (14336, 4096), (4096, 14336)] if CUDA else [])


def weights(n, k, gen):
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    scale = absmax_scale(w).view(-1)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def inputs(rows, k, gen):
    """Random rows. Interpreted, each row is already e4m3 values times its scale (its
    largest at 448): the interpreter's float32 -> e4m3 cast mis-rounds values that
    carry into the next power of two (127.2 -> 64), which compiled code does not."""
    x = torch.randn(rows, k, generator=gen)
    if CUDA:
        return x
    scale = absmax_scale(x)
    return (x / scale).to(FP8).float() * scale


def reference(x, q, scale, bias):
    xq = fp8_rows(x.float(), absmax_scale(x.float())).double()
    return F.linear(xq, q.double() * scale.double()[:, None],
                    None if bias is None else bias.double())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_skinny_kernel_is_the_w8a8_product(shape, rows, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    n, k = shape
    q, scale = weights(n, k, gen)
    x = inputs(rows, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = reference(x, q, scale, b)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = fp8_skinny_linear(dev(x), dev(q), dev(scale), dev(b))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # float32 accumulation of exact products: the order of the sum only
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-6 * k ** 0.5, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason="FP8 GEMMs need a GPU with FP8")
@pytest.mark.parametrize("library", ["fbgemm", "torch"])
@pytest.mark.parametrize("rows,k", [(1, 14336), (17, 4096), (64, 4096), (300, 4096)])
def test_gemm_paths_are_the_w8a8_product(rows, k, library, monkeypatch):
    if library == "torch":
        monkeypatch.setattr(fp8_linear, "fbgemm_rowwise", lambda device: None)
    elif fp8_linear.fbgemm_rowwise(torch.device("cuda")) is None:
        pytest.skip("fbgemm-gpu-genai is not installed for this torch, or not a Hopper GPU")
    gen = torch.Generator().manual_seed(rows)
    q, scale = weights(4096, k, gen)
    x = torch.randn(rows, k, generator=gen)
    want = reference(x.bfloat16(), q, scale, None)
    out = fp8_gemm(x.bfloat16().cuda(), q.cuda(), scale.cuda())
    assert out.dtype == torch.bfloat16
    # bfloat16 output: its own rounding, 2^-8 of values up to ~8
    torch.testing.assert_close(out.double().cpu(), want, atol=5e-2, rtol=1e-2)


@pytest.mark.skipif(not CUDA, reason="FP8 linears are made on GPUs with FP8")
def test_a_model_quantized_at_load_keeps_fp8_weights_and_its_tokens():
    """float32 on the GPU: the same greedy tokens as the CPU's de-quantized FP8 values
    (tests/test_quantization.py checks those against transformers), from weights that
    stay e4m3 in GPU memory."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.layers.fp8_linear import Fp8Linear
    from roseinfer.models.quantization import quantizable
    from tests.models import tiny_llama

    hf = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.05)
    prompts = [[5, 17, 99, 3], [200, 1, 42], [7] * 9, [300, 301, 302, 303, 304, 305]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(hf, device=device, dtype="float32", num_kv_blocks=64, block_size=8,
                 quantization="fp8", cpu_compiled_step="off") as llm:
            outs[device] = [o.token_ids for o in llm.generate(prompts, params)]
            if device == "cuda":
                # every linear but the LM head (bound as head.linear after quantizing)
                quantized = [(name, m) for name, m in quantizable(llm.engine.model)
                             if not name.startswith("head.")]
                others = [(name, type(m).__name__, m.weight.dtype) for name, m in quantized
                          if not (isinstance(m, Fp8Linear) and m.weight.dtype == FP8)]
                assert len(quantized) == 8 and not others, others
                assert llm.engine.model.head.linear.weight.dtype == torch.float32
    assert outs["cuda"] == outs["cpu"]
