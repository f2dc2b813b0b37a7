"""FP8 linear candidates against bf16 on the Llama-3-8B shapes (one GPU), per row count,
ms per call over 8 copies of the weight in one CUDA graph (weights from memory, as in a
decode step), each call including its activations' rounding to e4m3:

- bf16: cuBLAS, and the skinny kernel up to 16 rows (the unquantized baseline);
- ``layer``: layers/fp8_linear.py's Fp8Linear as it runs (the skinny FP8 kernel up to
  16 rows, ``torch._scaled_mm`` beyond);
- ``quantize``: its rounding of the rows alone;
- fbgemm-gpu-genai's, where it imports: ``f8f8bf16_rowwise`` (CUTLASS, row-wise scales,
  its launch settings picked per shape) and ``fp8fp8bf16_fast_gemv``, each after its
  ``quantize_fp8_per_row``.

Each candidate's error against the float64 product of the e4m3 weight is recorded at 16
rows (``err_*``: the largest difference over the largest magnitude).

Usage: python docs/bench/fp8_linears.py [--output-json F]
"""
import torch
import torch.nn.functional as F
from torch import nn

from int4_linears import fbgemm_ops
from linear_shapes import COPIES, per_call, run
from roseinfer.layers.fp8_linear import quantize_rows, to_fp8
from roseinfer.layers.skinny_linear import skinny_linear

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)


def measure(n, k):
    layers = []
    for _ in range(COPIES):
        layers.append(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        to_fp8(layers[-1])
    w16 = [(m.weight.float() * m.weight_scale[:, None]).bfloat16() for m in layers]
    ops = fbgemm_ops()
    candidates = {}
    if ops:
        def rowwise(x, m):
            xq, xs = ops.quantize_fp8_per_row(x)
            return ops.f8f8bf16_rowwise(xq, m.weight, xs, m.weight_scale)

        def gemv(x, m):
            xq, xs = ops.quantize_fp8_per_row(x)
            return ops.fp8fp8bf16_fast_gemv(xq, m.weight, xs, m.weight_scale)
        candidates = {"fbgemm_rowwise": rowwise, "fbgemm_gemv": gemv}
    row = {"fp8_floor_ms": n * k / 3.0e9, "bf16_floor_ms": 2 * n * k / 3.0e9}  # 3.0 TB/s
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row[f"bf16_cublas_m{m}"] = per_call(lambda i: F.linear(x, w16[i]))
        if m <= 16:
            row[f"bf16_skinny_m{m}"] = per_call(lambda i: skinny_linear(x, w16[i]))
        row[f"layer_m{m}"] = per_call(lambda i: layers[i](x))
        row[f"quantize_m{m}"] = per_call(lambda i: quantize_rows(x))
        for name, fn in candidates.items():
            if name == "fbgemm_gemv" and m > 16:
                continue
            try:
                row[f"{name}_m{m}"] = per_call(lambda i: fn(x, layers[i]))
                if m == 16:
                    row[f"err_{name}"] = error(fn(x, layers[0]), x, layers[0])
            except Exception as e:  # a row count the kernel does not serve
                row[f"{name}_m{m}"] = repr(e)[:120]
        if m == 16:
            row["err_layer"] = error(layers[0](x), x, layers[0])
    return row


def error(y, x, linear):
    w = linear.weight.double() * linear.weight_scale.double()[:, None]
    ref = x.double() @ w.t()
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


if __name__ == "__main__":
    run(measure)
