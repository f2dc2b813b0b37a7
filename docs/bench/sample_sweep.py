"""sample_advance (the decode graphs' sampler) inside a CUDA graph: greedy,
temperature only, and temperature with top-p, per num_warps, against
torch.argmax. Logits are random normal (a flat-ish distribution, as from
random weights).

Run on a GPU from the repository root: python3 docs/bench/sample_sweep.py
"""
import torch
from triton.testing import do_bench_cudagraph

from roseinfer.core import sample_kernel
from roseinfer.core.sample_kernel import WORDS, words
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.step_inputs import fixed_size, views
from roseinfer.core.step_kernels import sample_advance

MODES = {"greedy": SamplingParams(temperature=0.0),
         "T0.7": SamplingParams(temperature=0.7, seed=1),
         "T0.7,p0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1)}
for rows, vocab, dtype in ((128, 50257, torch.float16), (256, 128256, torch.bfloat16),
                           (64, 128256, torch.bfloat16)):
    logits = torch.randn(rows, vocab, device="cuda", dtype=dtype)
    ref = do_bench_cudagraph(lambda: logits.argmax(-1), rep=20) * 1e3
    line = [f"rows {rows} vocab {vocab} {dtype}: torch argmax {ref:.1f} us"]
    for mode, params in MODES.items():
        # 8192 table columns: positions advance with every replay
        state = torch.zeros(rows + 1, 8192 + WORDS, dtype=torch.int32, device="cuda")
        state[:rows, 8192:] = torch.tensor(words(params), dtype=torch.int32)
        sampled = torch.zeros(rows, dtype=torch.int32, device="cuda")
        window = torch.zeros(100000, rows, dtype=torch.int32, device="cuda")
        for w in (4, 8, 16, 32):
            sample_kernel.SAMPLE["num_warps"] = w
            inp = views(torch.zeros(fixed_size(rows, rows), dtype=torch.int32, device="cuda"),
                        rows, rows)
            t = do_bench_cudagraph(lambda: sample_advance(logits, inp, state, 8192, 1 << 20, sampled,
                                                          window), rep=20) * 1e3
            line.append(f"{mode} w{w} {t:.1f}")
    print("; ".join(line), flush=True)
