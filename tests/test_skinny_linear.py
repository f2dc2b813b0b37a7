"""The skinny linear kernel against F.linear in float64: interpreted on the CPU
(tiny shapes), compiled on a GPU (decode shapes, and inside a CUDA graph)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.skinny_linear import MAX_ROWS, SPLITS, SkinnyLinear, skinny_linear, \
    skinny_rows, use_skinny_linears

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("k", [96, 88])  # 88: the last K block partial
@pytest.mark.parametrize("split", [2, 4, 8])  # 8: more than K's blocks, so fewer splits
@pytest.mark.parametrize("rows", [1, 5])
def test_k_split_over_programs_sums_what_one_program_sums(rows, split, k, dtype):
    """Each tile's K over several programs, the last of which adds their partial sums in
    split order (core/arrivals.py): the product as without the split, and the counters
    left at zero for the next launch."""
    from roseinfer.core.arrivals import counters

    gen = torch.Generator().manual_seed(rows * 100 + split + k)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(72, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(72, generator=gen).to(dtype).to(DEVICE)
    config = (32, 16, 4, 2)  # 16-wide K blocks: 6 of them at K 96
    for _ in range(2):  # the second launch finds the counters zeroed by the first
        out = skinny_linear(x, w, b, config=config, split=split)
        whole = skinny_linear(x, w, b, config=config)
        tol = {torch.float32: 4e-7 * k ** 0.5, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(out.double(), reference(x, w, b), atol=tol, rtol=tol)
        torch.testing.assert_close(out, whole, atol=tol, rtol=tol)
    assert not counters(torch.device(DEVICE), 3)[:3].any()


def test_rows_past_the_tile_run_cublas_and_strided_rows_are_read_right():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(DEVICE).half()
    use_skinny_linears(lin, rows_faster=lambda linears: (MAX_ROWS, 1))
    assert type(lin) is SkinnyLinear
    big = torch.randn(MAX_ROWS + 1, 64, device=DEVICE).half()
    assert torch.equal(lin(big), F.linear(big, lin.weight, lin.bias))  # the same op
    strided = torch.randn(4, 128, device=DEVICE).half()[:, :64]
    torch.testing.assert_close(lin(strided).double(),
                               reference(strided, lin.weight, lin.bias), atol=2e-3, rtol=2e-3)


def test_swaps_the_half_precision_shapes_found_faster_by_shape():
    transposed = nn.Linear(32, 16).half()
    transposed.weight = nn.Parameter(transposed.weight.detach().t().contiguous().t())
    model = nn.Sequential(nn.Linear(32, 16).half(), nn.Linear(16, 64).half(),
                          nn.Linear(32, 16).half(), nn.Linear(32, 16), transposed,
                          nn.Linear(16, 32).half(), nn.Linear(32, 16, bias=False).half())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    asked = []

    def rows_faster(linears):  # the kernel "wins" up to 4 rows on 32 -> 16 with a bias only
        asked.append(linears)
        return (4 if linears[0].in_features == 32 and linears[0].bias is not None else 0), 1

    use_skinny_linears(model, rows_faster)
    # float32 and transposed weights are never timed; each other shape once, all together.
    assert len(asked) == 4 and [model[0], model[2]] in asked
    assert [type(m) for m in model] == [SkinnyLinear, nn.Linear, SkinnyLinear] + [nn.Linear] * 4
    assert model[0].max_rows == model[2].max_rows == 4
    x = torch.randn(5, 32).half()
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))  # past 4: cuBLAS
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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="times CUDA graphs")
def test_a_model_timed_at_load_computes_as_before():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, device="cuda", dtype=torch.bfloat16)
                            for _ in range(4)])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    use_skinny_linears(model)  # times both ways on this GPU
    assert {getattr(lin, "max_rows", 0) for lin in model} <= {0, 1, 4, MAX_ROWS}
    assert {getattr(lin, "split", 1) for lin in model} <= set(SPLITS)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    x = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    want = x.double()
    for lin in model:
        want = reference(want, lin.weight, lin.bias)
    torch.testing.assert_close(model(x).double(), want, atol=5e-2, rtol=5e-2)
