"""What logprobs and penalties cost on the GPU, and what one such request costs the
others in its batches.

GPT-2 small shape (random fp16 weights), 128 requests of 32 random ids, 256 new
tokens each, greedy, all submitted at once (W2-like); completion tokens per second
of one `generate` call after a warm-up call (and its fraction of the decode bytes
floor, prefill included in the time), for: no logits work; logprobs=5 on
every request; repetition_penalty=1.1 on every request; logprobs=5 on one request
of the 128. Run from the repository root on a GPU:
    python3 docs/bench/logits_cost.py [--model gpt2-random] [--dtype float16]
"""
import argparse
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.bench.floor import decode_floor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-random")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    llm = LLM(args.model, device="cuda", dtype=args.dtype, max_num_seqs=args.requests,
              enable_prefix_cache=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 50_000, (32,), generator=g).tolist()
               for _ in range(args.requests)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    cases = {
        "no logits work": [plain] * args.requests,
        "logprobs=5, every request": [SamplingParams(max_tokens=args.tokens, temperature=0,
                                                     ignore_eos=True, logprobs=5)] * args.requests,
        "repetition_penalty=1.1, every request": [SamplingParams(
            max_tokens=args.tokens, temperature=0, ignore_eos=True,
            repetition_penalty=1.1)] * args.requests,
        "logprobs=5, one request of them": [SamplingParams(
            max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=5)]
        + [plain] * (args.requests - 1),
    }
    floor = decode_floor(llm.engine, [32] * args.requests,
                         [args.tokens] * args.requests)["output_throughput"]
    print(torch.cuda.get_device_name(), args.model, args.dtype,
          f"decode bytes floor {floor:,.0f} tok/s")
    base = None
    for name, params in cases.items():
        llm.generate(prompts, params)  # warm-up: compiles, allocates
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
        base = base or rate
        print(f"{name:40s} {rate:10,.0f} tok/s  {rate / base:.2f}x  "
              f"{rate / floor:.0%} of the floor", flush=True)


if __name__ == "__main__":
    main()
