"""The scheduler's host time per step: Scheduler.schedule() over N decoding sequences.

A tiny random GPT-2 is stepped until N sequences decode; then a fresh Scheduler of this
tree over the same blocks and running sequences is timed, with the mixed-prefill cap off
(as on CUDA) and at 16 (the CPU's default). Run it per tree to compare two:

    PYTHONPATH=TREE python3 docs/bench/schedule_cost.py [--seqs 256] [--calls 2000]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from roseinfer import LLM, SamplingParams
from roseinfer.core.scheduler import Scheduler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    path = tempfile.mkdtemp()
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1000,
                               n_positions=512)).save_pretrained(path)
    engine = LLM(path, tokenizer=None, device="cpu", num_kv_blocks=4096, block_size=16,
                 max_num_seqs=args.seqs, cuda_graphs=False, cpu_compiled_step="off").engine
    for i in range(args.seqs):
        engine.add_request(f"r{i}", [1 + i % 50, 2, 3],
                           SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(4):
        engine.step()
    running = engine.scheduler.running
    assert len(running) == args.seqs, "every sequence must be decoding"
    for cap in (None, 16):
        s = Scheduler(engine.blocks, args.seqs, 8192, max_mixed_prefill_tokens=cap)
        s.running = list(running)
        for _ in range(50):
            s.schedule()
        start = time.perf_counter()
        for _ in range(args.calls):
            s.schedule()
        us = (time.perf_counter() - start) / args.calls * 1e6
        print(f"max_mixed_prefill_tokens={cap}: {us:.1f} us per schedule() "
              f"({args.seqs} decoding)")


if __name__ == "__main__":
    main()
