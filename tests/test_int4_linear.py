"""4-bit linears (layers/int4_linear.py): the rounding on every device, and on a GPU
torch's int4 kernel over the packed weight against the product with the de-quantized
weight, and a whole model quantized at load."""
import pytest
import torch

from roseinfer.layers.int4_linear import GROUP, dequantize, pack, quantize, runs_here

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_quantize_rounds_each_group_to_its_nearest_level():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=gen)
    levels, scale = quantize(w, 128)
    assert levels.min() >= 0 and levels.max() <= 15
    assert torch.equal(scale, scale.bfloat16().float())  # as the kernel keeps them
    err = (dequantize(levels, scale) - w).abs()
    assert (err <= scale.repeat_interleave(128, 1) / 2 + 1e-6).all()
    assert (levels.view(16, 2, 128) - 8).abs().amax(-1).eq(7).all()  # each group's largest


@needs_cuda
@pytest.mark.parametrize("rows", [1, 5, 16, 300])
@pytest.mark.parametrize("shape", [(256, 128), (4096, 4096), (4096, 14336), (28672, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_the_product_with_the_dequantized_weight(shape, rows):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    levels, scale = quantize(torch.randn(n, k, generator=gen) / k ** 0.5, GROUP)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    qweight, table = pack(levels.cuda(), scale.cuda())
    y = torch._weight_int4pack_mm(x.cuda(), qweight, GROUP, table)
    ref = x.double() @ dequantize(levels, scale).double().t()
    assert (y.cpu().double() - ref).norm() / ref.norm() < 1e-2


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
        packed = top1()
    monkeypatch.setattr(int4, "runs_here", lambda device, dtype: False)
    with LLM(hf, **config) as llm:
        assert not any(isinstance(m, Int4Linear) for m in llm.engine.model.modules())
        floats = top1()
    same = sum(a[0] == b[0] for a, b in zip(packed, floats))
    assert same >= 0.95 * len(floats)
    assert sum(abs(a[1] - b[1]) for a, b in zip(packed, floats)) / len(floats) < 0.05
