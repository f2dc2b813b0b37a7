"""The batched LoRA products (layers/lora_kernels.py) against a float64 loop over tokens:
tokens of several adapters and of none in one launch, fused slices of unequal widths,
ranks below the slots' rank, and the shrink's split over its inner dimension."""
import pytest
import torch

from roseinfer.core.triton_support import triton_usable
from roseinfer.layers.lora_kernels import DECODE_MAX_TOKENS, LoraBatch, add_lora

needs_triton = pytest.mark.skipif(not triton_usable("cpu") and not torch.cuda.is_available(),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _case(tokens, n_in, widths, slots=4, rank=16, used_rank=8, device="cpu",
          dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(widths), slots, rank, n_in)
    b = torch.zeros(len(widths), slots, max(widths), rank)
    a[:, :, :used_rank] = torch.randn(len(widths), slots, used_rank, n_in, generator=g) * 0.1
    for s, w in enumerate(widths):
        b[s, :, :w, :used_rank] = torch.randn(slots, w, used_rank, generator=g) * 0.1
    x = torch.randn(tokens, n_in, generator=g)
    y = torch.randn(tokens, sum(widths), generator=g)
    token_slots = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32)
    offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
    to = dict(device=device, dtype=dtype)
    return (x.to(**to), y.to(**to), a.to(**to), b.to(**to), offsets,
            token_slots.to(device), slots)


def _reference(x, y, a, b, offsets, token_slots):
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(a.shape[0]):
            lo, hi = offsets[s], offsets[s + 1]
            h = a[s, slot].double() @ x[t].double()
            out[t, lo:hi] += b[s, slot, :hi - lo].double() @ h
    return out


def _run(case, use_triton):
    x, y, a, b, offsets, token_slots, slots = case
    ends = torch.tensor(offsets, dtype=torch.int32, device=x.device)
    y = y.clone()
    add_lora(y, x, a, b, offsets, ends, LoraBatch(token_slots, slots), use_triton=use_triton)
    return y


@pytest.mark.parametrize("tokens", [1, 5, DECODE_MAX_TOKENS + 7])
def test_torch_path_equals_the_loop(tokens):
    case = _case(tokens, 40, [24, 8, 8])
    assert torch.allclose(_run(case, False).double(), _reference(*case[:-1]), atol=1e-5)


@needs_triton
@pytest.mark.parametrize("tokens, n_in, widths", [
    (1, 72, [72]),                              # batch 1: the shrink splits its inner dim
    (7, 1100, [48, 16, 16]),                    # q/k/v; inner dim past one split's block
    (40, 1100, [48, 16, 16]),                   # past a tile of one slot's tokens
    (DECODE_MAX_TOKENS + 9, 40, [130, 130]),   # gate/up at prefill size, past a tile
])
def test_triton_equals_the_loop(tokens, n_in, widths):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _case(tokens, n_in, widths, device=device)
    got = _run(case, True)
    want = _reference(*(t.cpu() if torch.is_tensor(t) else t for t in case[:-1]))
    # tensor cores multiply float32 as tf32 on CUDA
    tol = 2e-2 if device == "cuda" else 1e-4
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)
    untouched = case[5].cpu() < 0
    assert torch.equal(got.cpu()[untouched], case[1].cpu()[untouched])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [16, 48])
def test_bf16_on_the_gpu_inside_a_graph(tokens):
    """bf16 as served, captured in a CUDA graph, then replayed with other tokens' slots."""
    case = _case(tokens, 4096, [4096, 1024, 1024], slots=8, device="cuda",
                 dtype=torch.bfloat16)
    x, y, a, b, offsets, token_slots, slots = case
    ends = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    out, slot_buf = y.clone(), token_slots.clone()
    add_lora(out, x, a, b, offsets, ends, LoraBatch(slot_buf, slots))  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(out, x, a, b, offsets, ends, LoraBatch(slot_buf, slots))
    new_slots = token_slots.flip(0)
    slot_buf.copy_(new_slots)
    out.copy_(y)
    graph.replay()
    want = _reference(x.cpu(), y.cpu(), a.cpu(), b.cpu(), offsets, new_slots.cpu())
    assert torch.allclose(out.double().cpu(), want, atol=0.05, rtol=0.02)


@needs_triton
@pytest.mark.parametrize("fill", [-1, 2])
@pytest.mark.parametrize("tokens", [1, 20])
def test_triton_with_one_run(tokens, fill):
    """Every token of one adapter, or of none: one run of the sorted tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = list(_case(tokens, 64, [32, 16], device=device))
    case[5] = torch.full_like(case[5], fill)
    want = _reference(*(t.cpu() if torch.is_tensor(t) else t for t in case[:-1]))
    assert torch.allclose(_run(case, True).double().cpu(), want, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("split", [1, 3])  # 3: K's 96 over three programs of 32 a tile
def test_the_expand_in_the_skinny_linears_launch(tokens, split):
    """A small batch's expand runs in the base linear's own kernel (layers/lora.py):
    x @ w^T plus each token's product, fused q/k/v slices and tokens of no slot; with K
    split, in the epilogue of the tile's last split."""
    from roseinfer.layers.lora_kernels import shrink
    from roseinfer.layers.skinny_linear import skinny_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, _, a, b, offsets, token_slots, slots = _case(tokens, 96, [64, 32, 32], device=device)
    w = torch.randn(128, 96, generator=torch.Generator().manual_seed(1)).to(device) * 0.1
    ends = torch.tensor(offsets, dtype=torch.int32, device=device)
    batch = LoraBatch(token_slots, slots)
    got = skinny_linear(x, w, None, lora=(shrink(x, a, batch), b, token_slots, ends, 16),
                        config=(32, 32, 4, 2), split=split)
    cpu = (t.cpu() for t in (x, a, b))
    x64, a64, b64 = cpu
    want = _reference(x64, x64.double() @ w.cpu().double().T, a64, b64, offsets,
                      token_slots.cpu())
    tol = 2e-2 if device == "cuda" else 1e-4
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)
