"""Checks of CUDA-only code paths; skipped without a GPU."""
import pytest
import torch
import torch.nn.functional as F

from roseinfer.models.gpt2 import linear_gelu_tanh

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_gelu_epilogue_is_the_tanh_form(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).cuda().to(dtype)
    x = torch.randn(33, 64, device="cuda", dtype=dtype)
    ref = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()), approximate="tanh")
    erf = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()))
    out = linear_gelu_tanh(x, lin).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out - ref).norm() / ref.norm() < tol
    if dtype == torch.float32:  # fp16 rounding is as large as the erf/tanh gap
        assert (out - ref).abs().max() < (out - erf).abs().max()  # tanh, not erf
