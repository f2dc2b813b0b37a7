"""The skinny linear kernel against cuBLAS (F.linear) on decode shapes, on CUDA.

Each timing is one CUDA graph of the op over enough copies of the weight that
none comes from L2 (the best of 5 replays, divided by the copies), against the
bytes floor (the weight once, at 3.0 TB/s). Default: the kernel's own launch
settings, cuBLAS and it alternated 3 times. ``sweep``: every setting of CONFIGS.
``splits``: the kernel's own settings at each split of K in SPLITS.

    python3 docs/bench/skinny_linears.py [sweep | splits]
"""
import itertools
import sys

import torch
import torch.nn.functional as F

from roseinfer.layers.skinny_linear import SPLITS, graph_time, skinny_linear

torch.set_grad_enabled(False)
SHAPES = {"1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048),
          "1b.down": (2048, 8192), "1b.head": (128256, 2048),
          "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
          "8b.down": (4096, 14336), "8b.head": (128256, 4096),
          "gpt2.qkv": (2304, 768), "gpt2.o": (768, 768), "gpt2.fc": (3072, 768),
          "gpt2.proj": (768, 3072), "gpt2.head": (50304, 768),
          "smollm2.qkv": (960, 576), "smollm2.down": (576, 1536),
          "qwen2.5-1.5b.down": (1536, 8960), "phi3.qkv": (9216, 3072), "phi3.down": (3072, 8192),
          "qwen3-30b.qkv": (5120, 2048), "qwen3-30b.o": (2048, 4096),
          "gemma3-12b.o": (3840, 4096), "gemma3-12b.down": (3840, 15360)}
# (BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [c for c in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))]


def timed(fn) -> float:
    """Microseconds of one replay of a CUDA graph of ``fn``, the best of 5."""
    return graph_time(fn, replays=5) * 1e3


def shape_rows(sweep: bool, splits: bool):
    for name, (n, k) in SHAPES.items():
        if splits and name.startswith(("gpt2", "smollm2")) or name.endswith("head"):
            continue  # splits: where K is long against the columns' tiles
        copies = min(64, max(2, int(400e6 // (n * k * 2))))  # past the 50 MB L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor = n * k * 2 / 3.0e12 * 1e6
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = min(timed(lambda: [F.linear(x, w) for w in ws]) for _ in range(3)) / copies
            if sweep:
                found = []
                for cfg in CONFIGS:
                    try:
                        found.append((timed(lambda: [skinny_linear(x, w, config=cfg)
                                                     for w in ws]) / copies, cfg))
                    except Exception:  # a setting past the shared memory
                        continue
                us, cfg = min(found)
            elif splits:
                for split in SPLITS:
                    us = min(timed(lambda: [skinny_linear(x, w, split=split) for w in ws])
                             for _ in range(3)) / copies
                    print(f"{name:13s} rows {m:2d}  floor {floor:6.1f} us  cuBLAS {cublas:6.1f}"
                          f"  split {split}  skinny {us:6.1f} ({floor / us:4.0%})  "
                          f"skinny/cuBLAS {us / cublas:.2f}", flush=True)
                continue
            else:
                us, cfg = min(timed(lambda: [skinny_linear(x, w) for w in ws])
                              for _ in range(3)) / copies, "default"
            print(f"{name:13s} rows {m:2d}  floor {floor:6.1f} us  cuBLAS {cublas:6.1f} "
                  f"({floor / cublas:4.0%})  skinny {us:6.1f} ({floor / us:4.0%}) {cfg}  "
                  f"skinny/cuBLAS {us / cublas:.2f}", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    shape_rows("sweep" in sys.argv[1:], "splits" in sys.argv[1:])
