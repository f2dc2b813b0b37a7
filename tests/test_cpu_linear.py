"""CpuLinear: both CPU float32 kernels against F.linear, and the choice between them."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.cpu_linear import CpuLinear, _choose, choose_cpu_linears
from roseinfer.models.gpt2 import linear_gelu_tanh

KERNEL_PAIRS = [("plain", "plain"), ("packed", "packed"), ("plain", "packed"), ("packed", "plain")]


def _pair(kernels, bias=True, in_f=96, out_f=200):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    return lin, CpuLinear(lin, kernels)


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (3, 5, 96), (0, 96)])
def test_matches_f_linear(kernels, bias, shape):
    lin, cpu = _pair(kernels, bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = cpu(x)
    ref = F.linear(x, lin.weight, lin.bias)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
def test_strided_input_columns(kernels):
    """Column slices of a fused activation, as the model passes them."""
    lin, cpu = _pair(kernels)
    x = torch.randn(7, 3 * 96)[:, 96:192]
    with torch.inference_mode():
        torch.testing.assert_close(cpu(x), F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
@pytest.mark.parametrize("rows", [1, 16])
def test_gelu_is_the_tanh_form(kernels, rows):
    lin, cpu = _pair(kernels)
    x = torch.randn(rows, 96) * 3  # wide enough that the tanh and erf forms differ
    with torch.inference_mode():
        out = linear_gelu_tanh(x, cpu).double()
    pre = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
    assert (out - tanh).abs().max() < 1e-4
    assert (out - tanh).abs().max() < (out - erf).abs().max() / 10


def test_choose_one_kernel_unless_the_other_pays():
    t = lambda p1, p16, k1, k16: {"plain": {1: p1, 16: p16}, "packed": {1: k1, 16: k16}}
    assert _choose(t(1.0, 4.0, 1.05, 2.0)) == ("packed", "packed")  # within 10% at 1 row
    assert _choose(t(1.0, 2.0, 1.5, 1.0)) == ("plain", "packed")    # each wins by more
    assert _choose(t(1.0, 1.0, 2.0, 1.08)) == ("plain", "plain")


def test_choose_cpu_linears_swaps_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32, bias=False),
                          nn.Linear(64, 32, bias=False))
    x = torch.randn(4, 32)
    with torch.inference_mode():
        ref = model[2](model[1](model[0](x)))
        choose_cpu_linears(model)
        out = model[2](model[1](model[0](x)))
    assert all(not isinstance(m, nn.Linear) for m in model)
    assert model[2].kernels == model[3].kernels  # one choice per weight shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_timings_are_cached_per_machine_and_shape(tmp_path, monkeypatch):
    """A second load reads the timings instead of measuring; a damaged file is
    measured again and rewritten."""
    from roseinfer.layers import cpu_linear

    cache = tmp_path / "timings.json"
    make = lambda: nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))  # noqa: E731
    first = make()
    choose_cpu_linears(first, str(cache))
    assert len(json.loads(cache.read_text())) == 2  # one entry per weight shape

    def no_timing(weights):
        raise AssertionError("timed again despite the cache")
    monkeypatch.setattr(cpu_linear, "_time_kernels", no_timing)
    second = make()
    choose_cpu_linears(second, str(cache))
    assert [m.kernels for m in second] == [m.kernels for m in first]

    cache.write_text("{not json")
    monkeypatch.undo()
    choose_cpu_linears(make(), str(cache))
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize("cpuinfo, expected", [
    ("processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 23\nmodel\t\t: 1\n\n"
     "processor\t: 1\nmodel name\t: AMD EPYC\ncpu family\t: 23\nmodel\t\t: 1\n",
     "AMD EPYC (family 23, model 1)"),
    ("processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\n",
     "AMD EPYC (family 26, model 2)"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\n", None),  # no model name (an Arm VM): the platform's
])
def test_cpu_model_tells_apart_cpus_of_one_name(tmp_path, monkeypatch, cpuinfo, expected):
    """Timings are kept per CPU: two generations that a VM names alike get two keys."""
    import builtins
    import platform

    from roseinfer.layers import cpu_linear

    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
        fake if path == "/proc/cpuinfo" else path, *a, **k))
    got = cpu_linear.cpu_model()
    assert got == (expected or platform.processor() or platform.machine())


@pytest.mark.parametrize("kernels, copies", [(("plain", "plain"), None),
                                             (("packed", "packed"), "lm_head"),
                                             (("plain", "packed"), "fc, lm_head")])
def test_copies_beyond_the_weights_are_logged(monkeypatch, caplog, kernels, copies):
    """A packed head tied to the embedding, and a linear holding both layouts, take
    memory the checkpoint does not: the load says how much."""
    from roseinfer.layers import cpu_linear

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(64, 32)
            self.fc = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.wte.weight

    monkeypatch.setattr(cpu_linear, "_choose", lambda times: kernels)
    caplog.set_level("INFO", logger=cpu_linear.__name__)
    choose_cpu_linears(Tied())
    said = [r.getMessage() for r in caplog.records if "beyond" in r.getMessage()]
    assert [m.rsplit("of ", 1)[1] for m in said] == ([copies] if copies else [])
