"""The skinny kernel with each folded op (layers/folded.py) against the kernel alone, on the
Llama-3 8B and 1B decode shapes, on CUDA: µs a call over copies of the weight in one CUDA
graph (the best of 3), the tree before (``.base``, where it exists) beside it, and each
compiled variant's registers, spills and shared memory.

    python3 docs/bench/folded_linears.py [--rows 1,16]
"""
import argparse
import importlib.util
import os

import torch

from roseinfer.layers.fused import add_rms_norm, silu_and_mul
from roseinfer.layers.skinny_linear import PendingNorm, SummedRows, _skinny_kernel, \
    graph_time, skinny_linear

torch.set_grad_enabled(False)
# (BLOCK_N, BLOCK_K, warps, stages) beside the default
CONFIGS = [(32, 256, 4, 4), (32, 128, 4, 6), (32, 512, 8, 4)]
SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
          "8b.down": (4096, 14336), "1b.qkv": (3072, 2048), "1b.o": (2048, 2048),
          "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192)}


def base_kernel():
    """The tree before's skinny_linear, where .base holds it."""
    path = os.path.join(".base", "roseinfer", "layers", "skinny_linear.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("base_skinny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.skinny_linear


def variants(x, k, n, m):
    """name -> fn(w, config) of each way a linear of this shape runs with the op beside it:
    folded into the kernel, or the op's own launch (``-apart``) and the plain kernel."""
    dev, dt = x.device, x.dtype
    summed = SummedRows(x, torch.rand(128, m, device=dev))
    norm_w = torch.ones(k, device=dev, dtype=dt)
    pending = PendingNorm(summed, norm_w, 1e-5)
    gate_up = torch.randn(m, 2 * k, device=dev, dtype=dt)
    residual = torch.randn(m, n, device=dev, dtype=dt)
    return {
        "plain": lambda w, c: skinny_linear(x, w, config=c),
        "norm": lambda w, c: skinny_linear(pending, w, config=c),
        "norm-apart": lambda w, c: skinny_linear(add_rms_norm(x, None, norm_w, 1e-5)[0], w,
                                                 config=c),
        "add": lambda w, c: skinny_linear(x, w, config=c, residual=residual),
        "gated": lambda w, c: skinny_linear(gate_up, w, config=c, gated=1),
        "gated-apart": lambda w, c: skinny_linear(silu_and_mul(gate_up), w, config=c),
        "gated+add": lambda w, c: skinny_linear(gate_up, w, config=c, gated=1,
                                                residual=residual)}


def compiled_kernels():
    """(registers, spills, shared bytes, constexprs) of every compiled skinny variant."""
    out = []
    for cache in getattr(_skinny_kernel, "device_caches", {}).values():
        for key, kernel in cache[0].items():
            meta = getattr(kernel, "metadata", None)
            out.append((getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?"),
                        getattr(meta, "shared", "?"), getattr(meta, "num_stages", "?"),
                        str(key)[-160:]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--configs", action="store_true",
                    help="also time each variant at CONFIGS' launch settings")
    args = ap.parse_args()
    base = base_kernel()
    for name, (n, k) in SHAPES.items():
        copies = min(64, max(2, int(400e6 // (n * k * 2))))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
              for _ in range(copies)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            if base is not None:
                row["base"] = min(graph_time(lambda: [base(x, w) for w in ws])
                                  for _ in range(3)) * 1e3 / copies
            for label, fn in variants(x, k, n, m).items():
                for cfg in [None] + (CONFIGS if args.configs else []):
                    try:
                        us = min(graph_time(lambda: [fn(w, cfg) for w in ws]) for _ in range(3))
                    except Exception:  # a setting past the shared memory
                        continue
                    row[label if cfg is None else f"{label}{cfg}"] = us * 1e3 / copies
            print(f"{name:12s} rows {m:2d} " + "  ".join(f"{a} {b:6.1f}" for a, b in row.items()),
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    for regs, spills, shared, stages, key in compiled_kernels():
        print(f"regs {regs} spills {spills} shared {shared} stages {stages}  {key}")


if __name__ == "__main__":
    main()
