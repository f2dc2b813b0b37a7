"""One W4A16 kernel call (layers/int4_mma.py) on a Llama-3-8B shape, for Nsight Compute:
``ncu -k regex:w4a16 python3 docs/bench/int4_mma_once.py gate_up 1 0 1`` (shape, rows,
config, splits)."""
import sys

import torch

from linear_shapes import SHAPES
from roseinfer.layers import int4_mma

name, m, config, splits = sys.argv[1], *map(int, sys.argv[2:5])
n, k = SHAPES[name]
levels = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
meta = int4_mma.panels(torch.rand(k // 128, n, device="cuda").bfloat16())
words = int4_mma.pack(levels)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    int4_mma.mm(x, words, meta, meta, config, splits)
torch.cuda.synchronize()
