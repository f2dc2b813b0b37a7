"""greedy_advance's argmax settings against torch.argmax, kernel time inside a CUDA graph.

Run on a GPU from the repository root: python3 docs/bench/argmax_sweep.py
"""
import torch
from triton.testing import do_bench_cudagraph
from roseinfer.core import step_kernels as sk
from roseinfer.core.step_inputs import fixed_size, views
for rows, vocab, padded in ((128, 50257, 50304), (64, 50257, 50304), (128, 49152, 49152)):
    logits = torch.randn(rows, padded, device="cuda", dtype=torch.float16)[:, :vocab]
    buf = torch.zeros(fixed_size(rows, rows), dtype=torch.int32, device="cuda")
    inp = views(buf, rows, rows)
    tables = torch.zeros(rows + 1, 8192, dtype=torch.int32, device="cuda")
    sampled = torch.zeros(rows, dtype=torch.int32, device="cuda")
    window = torch.zeros(100000, rows, dtype=torch.int32, device="cuda")
    ref = do_bench_cudagraph(lambda: logits.argmax(-1), rep=20) * 1e3
    out = []
    for bv in (1024, 2048, 4096, 8192):
        for w in (4, 8, 16):
            sk.ARGMAX.update(block_v=bv, num_warps=w)
            buf.zero_()
            t = do_bench_cudagraph(lambda: sk.greedy_advance(logits, inp, tables, 16, sampled, window), rep=20) * 1e3
            out.append((t, bv, w))
    out.sort()
    print(f"rows {rows} vocab {vocab}: torch argmax {ref:.2f} us; best greedy_advance " + ", ".join(f"{bv}/{w} {t:.2f}" for t, bv, w in out[:5]), flush=True)
