"""The FP8 skinny kernel's launch settings on the Llama-3-8B shapes, rows 1-16, over rows
already rounded (QuantizedRows, as a norm hands them): µs per call over 8 copies of the
weight in one CUDA graph, and each one's largest difference from the float64 product
over the largest magnitude. (At tree d3542d0 the script, then fp8_dot.py, also timed
the products as e4m3 on the FP8 tensor cores against float16: docs/kernels.md.)

Usage: cd docs/bench && python3 fp8_skinny_sweep.py [--output-json F] [--shapes qkv,o,...]
"""
import itertools

import torch
from torch import nn

from linear_shapes import COPIES, per_call, run
from roseinfer.layers.fp8_linear import fp8_skinny_linear, quantize_rows, to_fp8

ROWS = (1, 4, 16)
CONFIGS = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((32, 64), (512, 1024), (4, 8),
                                                                 (3, 4))]


def measure(n, k):
    layers = []
    for _ in range(COPIES):
        layers.append(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        to_fp8(layers[-1])
    w = layers[0].weight.double() * layers[0].weight_scale.double()[:, None]
    row = {"fp8_bytes_us_at_4.2": n * k / 4.2e6}
    for m in ROWS:
        rows = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        ref = (rows.values.double() * rows.scales.double()) @ w.t()
        for cfg in CONFIGS:
            name = f"f16_n{cfg[0]}_k{cfg[1]}_w{cfg[2]}_s{cfg[3]}_m{m}"

            def call(i):
                m_ = layers[i]
                return fp8_skinny_linear(rows, m_.weight, m_.weight_scale, config=cfg)
            try:
                err = ((call(0).double() - ref).abs().max() / ref.abs().max()).item()
                row[name] = (round(per_call(call) * 1e3, 2), round(err, 5))
            except Exception as e:  # a setting that does not compile
                row[name] = repr(e)[:100]
    best = {}
    for key, val in row.items():
        if isinstance(val, tuple):
            kind, m = key.split("_")[0], key.rsplit("_", 1)[1]
            if (kind, m) not in best or val[0] < best[kind, m][1][0]:
                best[kind, m] = (key, val)
    for (kind, m), (key, val) in sorted(best.items()):
        print(f"  best {kind} {m}: {val[0]} us ({key}, err {val[1]})", flush=True)
    return row


if __name__ == "__main__":
    run(measure)
