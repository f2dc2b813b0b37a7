"""PackedLinear (oneDNN-prepacked CPU float32 linear) against F.linear."""
import pytest
import torch
import torch.nn.functional as F

from roseinfer.models.gpt2 import linear_gelu_tanh
from roseinfer.models.layers import PackedLinear


def _pair(bias: bool, in_f=96, out_f=200):
    torch.manual_seed(0)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    return lin, PackedLinear(lin)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (3, 5, 96), (0, 96)])
def test_matches_f_linear(bias, shape):
    lin, packed = _pair(bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = packed(x)
    ref = F.linear(x, lin.weight, lin.bias)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strided_input_columns():
    """Column slices of a fused activation, as the model passes them."""
    lin, packed = _pair(True)
    wide = torch.randn(7, 3 * 96)
    x = wide[:, 96:192]
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)


def test_gelu_epilogue_is_the_tanh_form():
    lin, packed = _pair(True)
    x = torch.randn(16, 96) * 3  # wide enough that tanh and erf forms differ
    with torch.inference_mode():
        out = linear_gelu_tanh(x, packed).double()
    pre = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
    assert (out - tanh).abs().max() < 1e-4
    assert (out - tanh).abs().max() < (out - erf).abs().max() / 10
