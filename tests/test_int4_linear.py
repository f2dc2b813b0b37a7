"""4-bit linears (layers/int4_linear.py): the rounding, the packing and both kernels
against the float64 product with the de-quantized weight (on the CPU through Triton's
interpreter, on a GPU compiled), and on a GPU a whole model quantized at load."""
import os

import pytest
import torch

from roseinfer.layers.int4_linear import dequantize, pack, packs, quantize, runs_here, \
    unpack, w4a16

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_triton = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"


def test_quantize_rounds_each_group_to_its_nearest_level():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=gen)
    levels, scale = quantize(w, 128)
    assert levels.min() >= 0 and levels.max() <= 15
    assert torch.equal(scale, scale.bfloat16().float())  # as the kernel keeps them
    err = (dequantize(levels, scale) - w).abs()
    assert (err <= scale.repeat_interleave(128, 1) / 2 + 1e-6).all()
    assert (levels.view(16, 2, 128) - 8).abs().amax(-1).eq(7).all()  # each group's largest


def test_packing_puts_16_consecutive_inputs_in_each_nibble_of_a_tiles_words():
    levels = torch.arange(2 * 256).remainder(16).view(2, 256)
    words = pack(levels)
    assert words.shape == (32, 2) and words.dtype == torch.int32
    for t, r, j in [(0, 0, 0), (0, 3, 5), (1, 15, 7), (1, 9, 2)]:
        nibble = (words[16 * t + r, 1].item() >> (4 * j)) & 15
        assert nibble == levels[1, 128 * t + 16 * j + r]


def test_what_packs():
    assert packs(4096, 128) and packs(4096, 64) and packs(4096, 32) and packs(4096, 4096)
    assert not packs(576, 64)   # not whole tiles: de-quantized instead
    assert not packs(4096, 48)  # a group that straddles 16-input slices


def packed(n, k, group, gen, zero_points=True):
    levels, scales = quantize(torch.randn(n, k, generator=gen), group)
    zeros = torch.randint(0, 16, scales.shape, generator=gen).float() if zero_points \
        else torch.full_like(scales, 8.0)
    ref = dequantize(levels, scales, zeros).double()
    bf = torch.bfloat16 if CUDA else torch.float32
    tensors = (pack(levels).to(DEVICE), scales.t().contiguous().to(DEVICE, bf),
               (-zeros * scales).t().contiguous().to(DEVICE, bf))
    return tensors, ref


@needs_triton
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_unpack_gives_every_weight(group):
    gen = torch.Generator().manual_seed(group)
    tensors, ref = packed(40, 512, group, gen)
    # bfloat16 keeps a scale times a level 0..15 exactly, and rounds the shift
    tol = 0 if not CUDA else 2 ** -7 * ref.abs().max().item()
    assert (unpack(*tensors).double().cpu().t() - ref).abs().max() <= tol


@needs_triton
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("group", [32, 128, 512])
def test_the_kernel_is_the_product_with_the_dequantized_weight(group, rows):
    gen = torch.Generator().manual_seed(group + rows)
    tensors, ref = packed(72, 512, group, gen)
    x = torch.randn(rows, 512, generator=gen)
    bias = torch.randn(72, generator=gen)
    y = w4a16(x.to(tensors[1]), *tensors, bias=bias.to(tensors[1])).double().cpu()
    want = x.double() @ ref.t() + bias.double()
    assert (y - want).norm() / want.norm() < (1e-2 if CUDA else 1e-5)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 300])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336), (28672, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_layer_on_real_shapes_at_every_size(shape, rows):
    """Up to 64 rows the kernel, beyond the de-quantized weight through cuBLAS."""
    from torch import nn

    from roseinfer.layers.int4_linear import to_int4
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    levels, scales = quantize(torch.randn(n, k, generator=gen) / k ** 0.5, 128)
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    to_int4(linear, levels.cuda(), scales.cuda())
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = x.double() @ dequantize(levels, scales).double().t()
    assert (linear(x.cuda()).double().cpu() - want).norm() / want.norm() < 1e-2


@needs_cuda
def test_a_model_quantized_at_load_runs_packed_weights_as_the_dequantized_ones(monkeypatch):
    """On a GPU, bfloat16, int4 at load: every linear but the LM head keeps packed
    weights, and scores each prompt's tokens as the same levels do as float weights:
    the same most likely token at >= 95 % of the positions (bfloat16 sums in another
    order move near-ties), log probabilities 0.05 apart on average."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.layers.int4_linear import Int4Linear
    from roseinfer.plugins.quantization import int4
    from tests.models import tiny_llama

    assert runs_here(torch.device("cuda"), torch.bfloat16)
    hf = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    initializer_range=0.05)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (60,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    config = dict(device="cuda", dtype="bfloat16", quantization="int4", num_kv_blocks=64)

    def top1():
        return [e.top[0] for o in llm.generate(prompts, params) for e in o.prompt_logprobs[1:]]

    with LLM(hf, **config) as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
        assert len(linears) == 4 * hf.config.num_hidden_layers  # qkv, o, gate_up, down
        packed_top = top1()
    monkeypatch.setattr(int4, "runs_here", lambda device, dtype: False)
    with LLM(hf, **config) as llm:
        assert not any(isinstance(m, Int4Linear) for m in llm.engine.model.modules())
        floats = top1()
    same = sum(a[0] == b[0] for a, b in zip(packed_top, floats))
    assert same >= 0.95 * len(floats)
    assert sum(abs(a[1] - b[1]) for a, b in zip(packed_top, floats)) / len(floats) < 0.05
