"""Every Triton kernel in the package reads only the globals Triton compiles: modules, other
kernels, Triton's own names and ``tl.constexpr`` values. Triton's interpreter (which runs
the kernels in this suite on the CPU) reads any global, so a plain ``EPS = 1e-6`` inside a
kernel passes every interpreted test and fails to compile on a GPU; this finds it here."""
import dis
import importlib
import pkgutil
import types

import pytest

import roseinfer
from roseinfer.core.triton_support import triton

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")


def kernels():
    """(qualified name, python function) of every ``triton.jit`` function in roseinfer."""
    found = {}
    for info in pkgutil.walk_packages(roseinfer.__path__, "roseinfer."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency absent here
            continue
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if isinstance(fn, types.FunctionType) and type(value).__module__.startswith("triton"):
                found[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return sorted(found.items())


def compiles_as_global(value) -> bool:
    """Triton's rule for a global a kernel names (its code generator's ``global_lookup``)."""
    tl = triton.language
    return (isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype))
            or type(value).__module__.startswith("triton")
            or getattr(value, "__module__", "").startswith("triton.language")
            or getattr(value, "__triton_builtin__", False))


def test_the_package_has_kernels():
    assert len(kernels()) > 20


@pytest.mark.parametrize("name,fn", kernels(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_kernel_names_only_globals_triton_compiles(name, fn):
    named = {i.argval for i in dis.get_instructions(fn) if i.opname == "LOAD_GLOBAL"}
    wrong = sorted(g for g in named if g in fn.__globals__
                   and not compiles_as_global(fn.__globals__[g]))
    assert not wrong, f"{name} reads {wrong}: pass them as tl.constexpr arguments"
