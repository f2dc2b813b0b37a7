"""Prompt rows through the GGUF blocks: the integer dots against the blocks de-quantized
into a GEMM (torch F.linear, oneDNN packed float32, oneDNN packed bfloat16, each with the
weight de-quantized and reordered in the call), on the default model's ffn_gate (Q4_1,
1536 x 576), over 64 copies in turn, two threads; µs a call.

    python3 docs/bench/cpu_gguf_prompt_gemm.py
"""
import time, torch
import torch.nn.functional as F
from roseinfer.layers import gguf_linear
import gguf, numpy as np
torch.set_num_threads(2)
ops = gguf_linear.build()
from roseinfer.models.loader import ALIASES
r = gguf.GGUFReader(ALIASES["smollm2"]())
t = [x for x in r.tensors if x.name == "blk.0.ffn_gate.weight"][0]
blocks = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(1536, -1)
copies = [blocks.clone() for _ in range(64)]
for rows in (16, 64, 512):
    x = torch.randn(rows, 576)
    def a(b): return F.linear(x, ops.dequantize(b, 3, 576))
    def p32(b): 
        w = torch.ops.mkldnn._reorder_linear_weight(ops.dequantize(b, 3, 576), rows)
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    def p16(b):
        w = torch.ops.mkldnn._reorder_linear_weight(ops.dequantize(b, 3, 576).bfloat16(), rows)
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), w, None, "none", [], "").float()
    def mm(b): return ops.mm(x, b, 3)
    for name, fn in (("dequant+F.linear", a), ("dequant+packed f32", p32), ("dequant+packed bf16", p16), ("int8 dots", mm)):
        for c in copies[:2]: fn(c)
        best = 1e9
        for _ in range(3):
            s = time.perf_counter()
            for c in copies: fn(c)
            best = min(best, (time.perf_counter() - s) / len(copies))
        print(rows, name, f"{best*1e6:.1f} us")
