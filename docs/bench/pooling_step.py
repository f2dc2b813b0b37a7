"""One pooling batch's time on its own: what a step beside decoding chats pays for the
embedding job (core/paired_engine.py). Times PoolingEngine.step(max_tokens) over queued
texts of TOKENS tokens, wall clock to the vectors on the host, and prints the profile's
top CPU and GPU entries of one such step.

Usage: python3 docs/bench/pooling_step.py [--tokens 128] [--budgets 128,512,2048]
"""
import argparse
import sys
import os
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from embeddings import SHAPES, build  # noqa: E402

from roseinfer.core.config import EngineConfig  # noqa: E402
from roseinfer.core.pooling_engine import PoolingEngine  # noqa: E402
from roseinfer.core.pooling_task import PoolingTask  # noqa: E402


def queue(pooler, n: int, tokens: int, words: int) -> None:
    texts = [torch.randint(5, words, (tokens,)).tolist() for _ in range(n)]
    pooler.add_request(f"r{time.perf_counter()}", pooler.prepare(PoolingTask("embed", texts)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--budgets", default="128,512,2048")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    folder = build(Path(tempfile.mkdtemp()), SHAPES["bge-large"])
    pooler = PoolingEngine(folder, config=EngineConfig(device=args.device, dtype=args.dtype))
    words = pooler.hf_config.vocab_size
    for budget in map(int, args.budgets.split(",")):
        queue(pooler, 400, args.tokens - 2, words)
        for _ in range(3):
            pooler.step(budget)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            pooler.step(budget)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"budget {budget} tokens ({budget // args.tokens} texts of {args.tokens}): "
              f"step {times[10] * 1e3:.2f} ms median, {times[2] * 1e3:.2f} min", flush=True)
        with torch.profiler.profile() as prof:
            pooler.step(budget)
        for key in ("cpu_time_total", "cuda_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))
        while pooler.has_unfinished():
            pooler.step()


if __name__ == "__main__":
    main()
