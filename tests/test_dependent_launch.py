"""Dependent launches (PDL): a kernel that the GPU starts while the one before it
drains must still read what that one wrote. On a Hopper GPU, a chain of decode
kernels, each reading the output of the one before, is captured in a CUDA graph with
PDL on and replayed on new inputs: every replay equals the chain launched eagerly
without PDL, bit for bit (the arithmetic is the same; only the launches differ)."""
import pytest
import torch

from roseinfer.core import triton_support
from roseinfer.core.triton_support import PDL_MAX_ROWS, _pdl_device, dependent_launch
from roseinfer.layers.fused import add_rms_norm, silu_and_mul
from roseinfer.layers.skinny_linear import skinny_linear

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_the_cpu():
    assert not dependent_launch(torch.device("cpu"), 1)


def _layers(n, hidden=1024, inter=2048):
    gen = torch.Generator(device="cuda").manual_seed(0)
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()
    return [(randn(hidden, scale=0.1) + 1, randn(2 * inter, hidden, scale=hidden ** -0.5),
             randn(hidden, inter, scale=inter ** -0.5)) for _ in range(n)]


def _chain(x, layers):
    residual = None
    for norm_w, up, down in layers:
        h, residual = add_rms_norm(x, residual, norm_w, 1e-5)
        x = skinny_linear(silu_and_mul(skinny_linear(h, up)), down)
    return add_rms_norm(x, residual, layers[0][0], 1e-5)[0]


def _eager_without_pdl(x, layers, monkeypatch):
    monkeypatch.setenv("ROSEINFER_PDL", "0")
    _pdl_device.cache_clear()
    try:
        return _chain(x, layers)
    finally:
        monkeypatch.delenv("ROSEINFER_PDL")
        _pdl_device.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="dependent launches need a Hopper GPU or later")
def test_graph_replays_with_pdl_equal_eager_launches_without(monkeypatch):
    _pdl_device.cache_clear()
    cuda = torch.device("cuda")
    assert dependent_launch(cuda, PDL_MAX_ROWS) and not dependent_launch(cuda, PDL_MAX_ROWS + 1)
    assert triton_support.triton is not None
    layers = _layers(16)
    x = torch.randn(4, 1024, device="cuda").bfloat16()
    _chain(x, layers)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, layers)
    for seed in range(10):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        want = _eager_without_pdl(x, layers, monkeypatch)
        assert torch.equal(out, want), f"replay {seed}"
