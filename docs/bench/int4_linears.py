"""INT4 (W4A16, groups of 128) linears against bf16 on the Llama-3-8B shapes (one GPU):
torch's int4 kernel (tinygemm) as `int4` runs it, at 1, 16 and 512 rows, ms per call,
against the packed bytes' floor at 3.0 TB/s. (The Triton kernels compared with it in
docs/kernels.md, "Tried and dropped", were measured by this script at `462e7e5`.)

Usage: python docs/bench/int4_linears.py [--output-json F]
"""
import torch
import torch.nn.functional as F

from linear_shapes import COPIES, per_call, run
from roseinfer.layers.int4_linear import GROUP, pack, quantize
from roseinfer.layers.skinny_linear import skinny_linear


def measure(n, k):
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
           for _ in range(COPIES)]
    packed = [pack(*quantize(w, GROUP)) for w in w16]
    row = {"int4_floor_ms": (n * k / 2 + n * k / GROUP * 4) / 3.0e9,
           "bf16_floor_ms": 2 * n * k / 3.0e9}
    for m in (1, 16, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if m <= 16:
            row[f"bf16_skinny_m{m}"] = per_call(lambda i: skinny_linear(x, w16[i]))
        row[f"bf16_cublas_m{m}"] = per_call(lambda i: F.linear(x, w16[i]))
        row[f"int4_m{m}"] = per_call(lambda i: torch._weight_int4pack_mm(x, *packed[i][:1], GROUP,
                                                                         packed[i][1]))
    return row


if __name__ == "__main__":
    run(measure)
