"""4-bit linears (layers/int4_linear.py): the rounding; the de-quantization kernel over
GPTQ's packed layout (on the CPU through Triton's interpreter, on a GPU compiled); on a
GPU the layer at every row count against the float64 product with the de-quantized
weight, and a whole model quantized at load."""
import os

import pytest
import torch

from roseinfer.layers.int4_linear import dequantize, packs, quantize, runs_here, unpack

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


def pack_words(levels):
    """Levels [N, K] -> GPTQ's (and GemLite's) int32 words [K / 8, N], input 8r + j in
    nibble j of word r."""
    q = levels.t().to(torch.int64).view(-1, 8, levels.shape[0])
    word = sum(q[:, j] << (4 * j) for j in range(8))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).contiguous()


def test_what_packs():
    assert packs(4096, 128) and packs(4096, 64) and packs(4096, 32) and packs(4096, 4096)
    assert not packs(576, 64)   # not whole tiles of 128: de-quantized instead
    assert not packs(4096, 24)


@needs_triton
@pytest.mark.parametrize("layout", ["gptq", "panels"])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_unpack_gives_every_weight(group, layout):
    """From GemLite's layout (GPTQ's) and from int4_mma's (panels of 32 columns, a
    word's nibbles in its order)."""
    from roseinfer.layers import int4_mma
    gen = torch.Generator().manual_seed(group)
    levels, scales = quantize(torch.randn(64, 512, generator=gen), group)
    zeros = torch.randint(0, 16, scales.shape, generator=gen).float()
    ref = dequantize(levels, scales, zeros).double()
    bf = torch.bfloat16 if CUDA else torch.float32
    words, meta = (pack_words, torch.Tensor.contiguous) if layout == "gptq" else \
        (int4_mma.pack, int4_mma.panels)
    got = unpack(words(levels).to(DEVICE), meta(scales.t()).to(DEVICE, bf),
                 meta((-zeros * scales).t()).to(DEVICE, bf))
    # a scale times a level 0..15 is exact; bfloat16 rounds the shift
    tol = 0 if not CUDA else 2 ** -7 * ref.abs().max().item()
    assert (got.double().cpu().t() - ref).abs().max() <= tol


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 16, 64, 300])
@pytest.mark.parametrize("shape,group", [((4096, 4096), 128), ((4096, 14336), 128),
                                         ((28672, 4096), 128), ((1024, 4096), 32),
                                         ((1024, 4096), 64), ((1024, 4096), 4096)],
                         ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else s)
def test_the_layer_is_the_product_with_the_dequantized_weight(shape, group, rows):
    """GemLite's kernels up to 64 rows, the de-quantized weight through cuBLAS beyond;
    zero points per group (as AWQ's), per-channel scales as one group of all inputs."""
    from torch import nn

    from roseinfer.layers.int4_linear import Int4Linear, to_int4
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows + group)
    levels, scales = quantize(torch.randn(n, k, generator=gen) / k ** 0.5, group)
    zeros = torch.randint(4, 12, scales.shape, generator=gen).float()
    linear = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    to_int4(linear, levels.cuda(), scales.cuda(), zeros.cuda())
    assert isinstance(linear, Int4Linear) and not hasattr(linear, "weight")
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = x.double() @ dequantize(levels, scales, zeros).double().t() + \
        linear.bias.double().cpu()
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
        packed = top1()
    monkeypatch.setattr(int4, "runs_here", lambda device, dtype: False)
    with LLM(hf, **config) as llm:
        assert not any(isinstance(m, Int4Linear) for m in llm.engine.model.modules())
        floats = top1()
    same = sum(a[0] == b[0] for a, b in zip(packed, floats))
    assert same >= 0.95 * len(floats)
    assert sum(abs(a[1] - b[1]) for a, b in zip(packed, floats)) / len(floats) < 0.05


@needs_cuda
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_a_checkpoint_loads_packed_and_runs_as_its_dequantized_values(tmp_path, monkeypatch,
                                                                      layout):
    """An AWQ or GPTQ checkpoint (packed from the formats' specs, zero points per group)
    loads packed on a GPU, and scores each prompt's tokens as its de-quantized values
    do in bfloat16: the same most likely token at >= 95 % of the positions."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.layers.int4_linear import Int4Linear
    from roseinfer.plugins.quantization import int4
    from tests.models import tiny_llama
    from tests.test_quantization import hand_packed

    hf = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.05)
    path, _ = hand_packed(hf, tmp_path, layout)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 512, (60,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    config = dict(device="cuda", dtype="bfloat16", num_kv_blocks=64)

    def top1(llm):
        return [e.top[0][0] for o in llm.generate(prompts, params)
                for e in o.prompt_logprobs[1:]]

    with LLM(path, **config) as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
        assert len(linears) == 4 * hf.config.num_hidden_layers
        packed = top1(llm)
    monkeypatch.setattr(int4, "runs_here", lambda device, dtype: False)
    with LLM(path, **config) as llm:
        floats = top1(llm)
    assert sum(a == b for a, b in zip(packed, floats)) >= 0.95 * len(floats)


class FakeGemLite(torch.nn.Module):
    """GemLite's linear as Int4Linear holds it (``W_q`` in GPTQ's layout, ``scales``,
    ``zeros`` holding the shifts), its kernels replaced by the product with the weight
    ``unpack`` de-quantizes: so the rest of the packed path runs on the CPU."""

    def __init__(self, levels, scales, zeros):
        super().__init__()
        shifts = (-zeros.float() * scales.float()).to(scales.dtype)
        for name, t in (("W_q", pack_words(levels)), ("scales", scales.t().contiguous()),
                        ("zeros", shifts.t().contiguous())):
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))
        self.kinds = []

    def forward_manual(self, x, kind):
        self.kinds.append(kind)
        return x @ unpack(self.W_q, self.scales, self.zeros)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the packed path on the CPU, through Triton's interpreter")
def test_a_checkpoint_packs_through_the_loader_and_runs_its_values(tmp_path, monkeypatch):
    """An AWQ checkpoint loads packed (the packed linear's own state through the model's
    strict loading), and greedy tokens equal transformers' on its de-quantized values:
    decode rows through the kernels' entry (one row, and several), a 100-token prompt
    through the de-quantized buffer and a matmul."""
    from roseinfer import LLM, SamplingParams
    from roseinfer.layers import int4_linear
    from roseinfer.layers.int4_linear import Int4Linear
    from roseinfer.plugins.quantization import int4
    from tests.models import hf_greedy, tiny_llama
    from tests.test_quantization import SHAPE, hand_packed, with_weights

    monkeypatch.setattr(int4, "runs_here", lambda device, dtype: True)
    monkeypatch.setattr(int4_linear, "gemlite_linear", FakeGemLite)
    hf = tiny_llama(**SHAPE)
    path, values = hand_packed(hf, tmp_path, "awq")
    prompts = [list(range(5, 105)), [5, 17, 99, 3], [7] * 9]
    with LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
             cpu_compiled_step="off") as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
        assert len(linears) == 4 * hf.config.num_hidden_layers
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        alone = llm.generate([prompts[1]], params)[0].token_ids  # one row a decode step
    kinds = {k for m in linears for k in m.kernel.kinds}
    assert kinds == {"GEMV_REVSPLITK", "GEMM_SPLITK"}  # one row, several (>64: no call)
    assert alone == got[1]
    reference = with_weights(hf, lambda name, _: values[name])
    assert got == [hf_greedy(reference, p, 6) for p in prompts]
