"""Lower-precision linear weights on the CPU (cpu_weight_dtype), against the same
rounding done by hand on a transformers model, and against float32."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roseinfer import LLM
from roseinfer.core.errors import ConfigError
from roseinfer.layers.cpu_linear import CpuLinear
from roseinfer.layers.cpu_weights import RoundedLinear
from tests.models import hf_greedy, tiny_llama
from tests.test_greedy_equality import GREEDY, mixed_prompts

BF16 = torch.bfloat16
needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="oneDNN has no bfloat16 kernels on this CPU")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16), "int8"]


def rounded_by_hand(x, weight, bias, weight_dtype):
    """What RoundedLinear computes, in float32 ops: bfloat16 inputs, the weight as
    stored, the kernel's bfloat16 output, then scales and bias in float32."""
    x = x.to(BF16).float()
    if weight_dtype == "bfloat16":
        out, scale = F.linear(x, weight.to(BF16).float()), 1.0
    else:
        scale = weight.abs().amax(dim=1) / 127
        out = F.linear(x, (weight / scale[:, None]).round())
    out = out.to(BF16).float() * scale
    return out if bias is None else out + bias


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("width", [96, 72])  # 72: not a multiple of the int8 kernel's 16
def test_rounded_linear_matches_the_rounding_done_by_hand(weight_dtype, rows, width):
    torch.manual_seed(0)
    linear = nn.Linear(width, 80)
    x = torch.randn(2, rows, width)
    with torch.inference_mode():
        out = RoundedLinear(linear, weight_dtype)(x)
        want = rounded_by_hand(x, linear.weight, linear.bias, weight_dtype)
        exact = linear(x)
    assert out.dtype == torch.float32 and out.shape == (2, rows, 80)
    # The kernels sum in another order: a bfloat16 rounding step at most apart.
    torch.testing.assert_close(out, want, rtol=8e-3, atol=1e-3)
    err = (out - exact).norm() / exact.norm()
    assert 1e-4 < err < (5e-3 if weight_dtype == "bfloat16" else 1.5e-2), err


def reference_model(hf, weight_dtype):
    """transformers' model with its linears rounded by hand as RoundedLinear rounds
    them: every one for bfloat16, all but the LM head for int8."""
    ref = copy.deepcopy(hf)
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear) and (name != "lm_head" or weight_dtype == "bfloat16"):
            module.forward = (lambda m: lambda x: rounded_by_hand(
                x, m.weight, m.bias, weight_dtype))(module)
    return ref


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_greedy_tokens_equal_transformers_rounded_the_same_way(weight_dtype):
    hf = tiny_llama()
    llm = LLM(hf, device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              cpu_weight_dtype=weight_dtype)
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.qkv_proj, RoundedLinear) and isinstance(layer.down_proj, RoundedLinear)
    head = RoundedLinear if weight_dtype == "bfloat16" else CpuLinear  # int8's stays float32
    assert isinstance(llm.engine.model.head.linear, head)
    ref = reference_model(hf, weight_dtype)
    prompts = mixed_prompts(4, seed=3)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(ref, prompt, GREEDY.max_tokens), prompt


def test_cpu_weight_dtype_is_checked():
    with pytest.raises(ConfigError, match="float32, bfloat16, int8 or gguf"):
        LLM(tiny_llama(), device="cpu", cpu_weight_dtype="int4")
    with pytest.raises(ConfigError, match="applies to float32 models on the CPU"):
        LLM(tiny_llama(), device="cpu", dtype="bfloat16", cpu_weight_dtype="int8")
