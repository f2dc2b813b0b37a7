"""One decode step of the gated delta rule in place in the state rows
(layers/recurrent_decode.py): the Triton kernel (interpreted on the CPU) against its torch
form, and that against the layer's closed form (layers/gated_deltanet.py ``delta_rule``),
with fresh rows starting from zeros and rows the batch does not name left as they were."""
import pytest
import torch

from roseinfer.core.triton_support import triton_usable
from roseinfer.layers.gated_deltanet import delta_rule
from roseinfer.layers.mamba2 import ssm_scan
from roseinfer.layers.recurrent_decode import conv_decode_in_place, conv_decode_torch, \
    delta_decode_in_place, delta_decode_torch, delta_gates, ssm_decode_in_place, \
    ssm_decode_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batch(seed: int, key_heads=2, value_heads=4, dk=16, dv=48, rows=7, dtype=torch.float32):
    """Gated DeltaNet's decode inputs: q, k [B, key heads, K], v [B, value heads, V], the
    gates' inputs [B, key heads, 2 x value heads a key head], A_log and dt_bias; states
    [rows, value heads, K, V]; rows; fresh."""
    gen = torch.Generator().manual_seed(seed)
    b = 3
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    ba = randn(b, key_heads, 2 * value_heads // key_heads) * 3  # some a + dt_bias past 20
    ba[0, 0, -1] = 30.0
    args = (randn(b, key_heads, dk).to(dtype), randn(b, key_heads, dk).to(dtype),
            randn(b, value_heads, dv).to(dtype), ba.to(dtype), randn(value_heads),
            randn(value_heads))
    state = randn(rows, value_heads, dk, dv)
    return [a.to(DEVICE) for a in args], state.to(DEVICE), torch.tensor([5, 0, 2], device=DEVICE), \
        torch.tensor([False, True, False], device=DEVICE)


@pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton runs on CUDA or interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_delta_rule_kernel_equals_its_torch_form(dtype):
    args, state, rows, fresh = batch(0, dtype=dtype)
    want_state = state.clone()
    want = delta_decode_torch(*args, want_state, rows, fresh)
    got = delta_decode_in_place(*args, state, rows, fresh)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def equals_the_closed_form(step, closed, args, state, rows, fresh):
    """``step`` (a decode in plain torch) against ``closed`` (the layer's form over [B, T]
    inputs) at one token: outputs, the rows' states, and the other rows untouched."""
    before = state.clone()
    out = step(*args, state, rows, fresh)
    start = before[rows].masked_fill(fresh.view(-1, 1, 1, 1), 0)
    want, end = closed(*(t[:, None] for t in args), start.clone())
    torch.testing.assert_close(out, want[:, 0].to(out.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[rows], end, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(state.shape[0]) if r not in rows.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_the_delta_rule_torch_form_equals_the_closed_form():
    args, state, rows, fresh = batch(1)
    q, k, v, ba, a_log, dt_bias = args

    def closed(q, k, v, ba, start):
        g, beta = delta_gates(ba, a_log, dt_bias)
        return delta_rule(q, k, v, g, beta, start)
    equals_the_closed_form(lambda q, k, v, ba, *rest: delta_decode_torch(
        q, k, v, ba, a_log, dt_bias, *rest), closed, [q, k, v, ba], state, rows, fresh)


def ssm_batch(seed: int, heads=4, p=40, n=16, rows=6):
    """Mamba2's decode inputs: x [B, H, P], dt, a [B, H], b, c [B, H, N]; states [rows, H,
    P, N]; rows; fresh."""
    gen = torch.Generator().manual_seed(seed)
    b = 3
    dt = torch.rand(b, heads, generator=gen)
    args = (torch.randn(b, heads, p, generator=gen), dt, -dt * torch.rand(heads, generator=gen),
            torch.randn(b, heads, n, generator=gen), torch.randn(b, heads, n, generator=gen))
    state = torch.randn(rows, heads, p, n, generator=gen)
    return [t.to(DEVICE) for t in args], state.to(DEVICE), \
        torch.tensor([4, 1, 0], device=DEVICE), torch.tensor([True, False, False], device=DEVICE)


@pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton runs on CUDA or interpreted")
def test_the_ssm_kernel_equals_its_torch_form():
    args, state, rows, fresh = ssm_batch(2)
    want_state = state.clone()
    want = ssm_decode_torch(*args, want_state, rows, fresh)
    got = ssm_decode_in_place(*args, state, rows, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def test_the_ssm_torch_form_equals_the_closed_form():
    equals_the_closed_form(ssm_decode_torch, ssm_scan, *ssm_batch(3))


@pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton runs on CUDA or interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_convolution_kernel_equals_its_torch_form(dtype, bias):
    """The depthwise causal convolution and SiLU of one token a sequence (a 4-tap kernel
    over 200 channels: a block and a part): outputs, the rows' inputs moved on (a fresh
    row's from zeros), the other rows untouched; x read through its row stride."""
    gen = torch.Generator().manual_seed(4)
    channels, taps = 200, 4
    conv = torch.nn.Conv1d(channels, channels, taps, groups=channels, bias=bias)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    conv = conv.to(DEVICE, dtype)
    x = torch.randn(3, channels + 8, generator=gen).to(DEVICE, dtype)[:, :channels]
    state = torch.randn(5, channels, taps - 1, generator=gen).to(DEVICE, dtype)
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    fresh = torch.tensor([False, True, False], device=DEVICE)
    want_state = state.clone()
    want = conv_decode_torch(x, want_state, conv, rows, fresh)
    got = conv_decode_in_place(x, state, conv, rows, fresh)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)  # moved, not computed
    assert torch.equal(state[[1, 2]], want_state[[1, 2]])
