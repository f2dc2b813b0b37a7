"""The LoRA shrink and expand of one projection (layers/lora_kernels.py), decode and prompt
sizes,
per Llama-3-8B projection and token count, for several tilings (TILES),
each call replayed 100 times in a CUDA graph (the tokens' grouping, once per forward,
made before); beside the bytes floor of the adapters'
weights the call reads (A and B of every slot in use) and the base projection's own
cuBLAS GEMM.

Usage: PYTHONPATH=. python3 docs/bench/lora_kernels.py [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from roseinfer.layers import lora_kernels
from roseinfer.layers.lora_kernels import LoraBatch, add_lora

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]),
          "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
DECODE_TILINGS = [(512, 8, 128, 64), (256, 64, 256, 64), (256, 64, 256, 128),
                  (1024, 16, 128, 128), (512, 32, 128, 128), (512, 8, 128, 256)]
PROMPT_TILINGS = [(1 << 30, 1, 32, 128), (1 << 30, 1, 128, 128), (2048, 8, 64, 128),
                  (1024, 16, 128, 128), (512, 32, 128, 128)]


def replay_us(fn, reps: int = 100) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-json", default=None)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    rows = []
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for name, (n_in, widths) in SHAPES.items():
        a = torch.randn(len(widths), args.slots, args.rank, n_in, **bf16) * 0.01
        b = torch.randn(len(widths), args.slots, max(widths), args.rank, **bf16) * 0.01
        w = torch.randn(sum(widths), n_in, **bf16) * 0.01
        offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
        ends = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        for tokens in (1, 8, 64, 512, 2048):
            x = torch.randn(tokens, n_in, **bf16)
            y = torch.zeros(tokens, sum(widths), **bf16)
            slots = torch.arange(tokens, device="cuda", dtype=torch.int32) % args.slots
            used = min(tokens, args.slots)
            floor_us = used * (a[:, 0].numel() + b[:, 0].numel()) * 2 / 4.0e6  # 4 TB/s
            row = {"proj": name, "tokens": tokens, "floor_us": round(floor_us, 2),
                   "gemm_us": round(replay_us(lambda: x @ w.T), 2)}
            batch = LoraBatch(slots, args.slots)
            batch.grouped()  # once per forward in a step: not timed here
            for tiling in DECODE_TILINGS if tokens <= 64 else PROMPT_TILINGS:
                lora_kernels.TILES = ((1 << 62, tiling),)

                def call():
                    add_lora(y, x, a, b, offsets, ends, batch)
                row[str(tiling)] = round(replay_us(call), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
