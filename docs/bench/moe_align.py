"""The MoE alignment (layers/moe.py ``align_blocks``) per call: the one-program Triton
kernel (at any pair count) against torch's way, inside a CUDA graph, at decode shapes of
the MoE families (Mixtral's 8 experts, Qwen3's 128, Qwen3-Next's 512).

    python3 docs/bench/moe_align.py
"""
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_sweep import time_graph  # noqa: E402

from roseinfer.layers import moe  # noqa: E402

# (tokens, experts, top_k)
SHAPES = [(1, 8, 2), (64, 8, 2), (1, 128, 8), (16, 128, 8), (64, 128, 8), (256, 128, 8),
          (1, 512, 10), (16, 512, 10), (64, 512, 10), (128, 512, 10), (256, 512, 10)]
BLOCK_M = 16
CALLS = 10


def main():
    print(f"{torch.cuda.get_device_name()}; one-program bound {moe.ALIGN_IN_ONE_PROGRAM} pairs")
    moe.ALIGN_IN_ONE_PROGRAM = 1 << 30  # the kernel at every size; torch's way by name below
    for tokens, experts, top_k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = [torch.randint(0, experts, (tokens, top_k), generator=g, device="cuda",
                             dtype=torch.int32) for _ in range(CALLS)]
        us = {}
        for name, use in (("triton", True), ("torch", False)):
            calls = [functools.partial(moe.align_blocks, i, experts, BLOCK_M, use_triton=use)
                     for i in ids]
            us[name] = time_graph(calls) * 1e6
        print(f"{tokens:4d} tokens x top {top_k:2d} of {experts:3d} experts "
              f"({tokens * top_k:5d} pairs): one program {us['triton']:7.2f} us, "
              f"torch {us['torch']:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
