"""Where a batch of prompts' prefill goes: ``--prompts`` random prompts of ``--input-len``
tokens, one output token each, through ``LLM.generate`` (the engine's own chunking),
timed warm, then under torch's profiler: prompt tokens a second and the kernels that
take the most GPU time, grouped by name.

Usage: python3 docs/bench/prefill_profile.py [--model granite-4.0-h-small-random]
  [--quantization fp8] [--prompts 64] [--input-len 512] [--top 30]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from roseinfer import LLM, SamplingParams


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="granite-4.0-h-small-random")
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    llm = LLM(args.model, quantization=args.quantization or None, max_num_seqs=args.prompts)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, llm.engine.vocab_size, (args.input_len,),
                             generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def call():
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    call()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    print(f"{args.model} {args.quantization}: {args.prompts} x {args.input_len} prompt tokens "
          f"in {seconds:.3f} s = {args.prompts * args.input_len / seconds:,.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main()
