"""The skinny linear kernel against F.linear in float64: interpreted on the CPU
(tiny shapes), compiled on a GPU (decode shapes, and inside a CUDA graph)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.models.skinny_linear import HEAD_COLS, LONG_ROWS, MAX_ROWS, SkinnyLinear, \
    skinny_linear, use_skinny_linears

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (out, in): in a multiple of the K block, not one, and under one tile of 16.
SHAPES = [(40, 64), (100, 96), (33, 8)] + ([(3072, 2048), (2048, 8192)] if CUDA else [])
# The interpreter truncates float32 -> bfloat16 instead of rounding: bf16 compiled only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_linear(rows, shape, dtype, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    n, k = shape
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    out = skinny_linear(x, w, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    want = reference(x, w, b)
    # float32 accumulation: only the output's own rounding, and in float32 the order of
    # the sum (~sqrt(K) roundings); TF32 products would be off by ~1e-3.
    tol = {torch.float32: 4e-7 * k ** 0.5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_rows_past_the_tile_run_cublas_and_strided_rows_are_read_right():
    torch.manual_seed(0)
    lin = nn.Linear(LONG_ROWS, 48).to(DEVICE).half()
    use_skinny_linears(lin)
    assert type(lin) is SkinnyLinear
    big = torch.randn(MAX_ROWS + 1, LONG_ROWS, device=DEVICE).half()
    assert torch.equal(lin(big), F.linear(big, lin.weight, lin.bias))  # the same op
    strided = torch.randn(4, 2 * LONG_ROWS, device=DEVICE).half()[:, :LONG_ROWS]
    torch.testing.assert_close(lin(strided).double(),
                               reference(strided, lin.weight, lin.bias), atol=2e-3, rtol=2e-3)


def test_swaps_the_half_precision_shapes_it_runs_faster_only():
    transposed = nn.Linear(LONG_ROWS, 8).half()
    transposed.weight = nn.Parameter(transposed.weight.detach().t().contiguous().t())
    model = nn.Sequential(nn.Linear(LONG_ROWS, 8).half(), nn.Linear(8, HEAD_COLS).half(),
                          nn.Linear(LONG_ROWS, 8), transposed, nn.Linear(LONG_ROWS // 2, 8).half())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    use_skinny_linears(model)
    assert [type(m) for m in model] == [SkinnyLinear] * 2 + [nn.Linear] * 3
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_replays_inside_a_cuda_graph():
    torch.manual_seed(0)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 45
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    skinny_linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.double(), reference(x, w, None), atol=1.6e-2, rtol=1.6e-2)
