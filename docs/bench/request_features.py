"""What structured output costs on the GPU, and what n > 1 saves.

Structured output: 128 requests of 32 random ids -> 256 tokens, greedy, submitted
at once (the logits-cost bench's shape): no logits work; response_format
json_object on every request; on one request of the 128.
n: 128 completions of 512-token prompts -> 128 tokens, sampled (temperature 1,
seeded), as 128 distinct prompts against 32 prompts with n = 4.
Completion tokens per second of one `generate` call after a warm-up call.
Run from the repository root on a GPU:
    python3 docs/bench/request_features.py [--model gpt2-random] [--dtype float16]
        [--decode-steps 8] [--gpt2-tokenizer]
"""
import argparse
import tempfile
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.models.tokenizers import gpt2_tokenizer


def timed(llm, prompts, params) -> float:
    llm.generate(prompts, params)  # warm-up: compiles grammars, captures, allocates
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    samples = [o for out in outs for o in (out if isinstance(out, list) else [out])]
    return sum(len(o.token_ids) for o in samples) / (time.perf_counter() - start)


def ids(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 50_000, (length,), generator=g).tolist() for _ in range(n)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-random")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--gpt2-tokenizer", action="store_true",
                   help="give the model GPT-2's tokenizer (random shapes have none; the "
                        "grammar needs one)")
    args = p.parse_args()
    tok = gpt2_tokenizer(tempfile.mkdtemp()) if args.gpt2_tokenizer else None
    llm = LLM(args.model, tokenizer=tok, device="cuda", dtype=args.dtype, max_num_seqs=128,
              enable_prefix_cache=False, decode_steps=args.decode_steps)
    print(torch.cuda.get_device_name(), args.model, args.dtype,
          f"decode_steps {args.decode_steps}", flush=True)
    prompts = ids(128, 32, 0)
    plain = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True,
                            response_format={"type": "json_object"})
    cases = {"no logits work": [plain] * 128,
             "json_object, every request": [shaped] * 128,
             "json_object, one request of them": [shaped] + [plain] * 127}
    base = None
    for name, params in cases.items():
        rate = timed(llm, prompts, params)
        base = base or rate
        print(f"{name:40s} {rate:10,.0f} tok/s  {rate / base:.2f}x", flush=True)
    long = ids(128, 512, 1)
    sampled = dict(max_tokens=128, temperature=1.0, ignore_eos=True)
    distinct = timed(llm, long, [SamplingParams(seed=i, **sampled) for i in range(128)])
    shared = timed(llm, long[:32], [SamplingParams(n=4, seed=4 * i, **sampled)
                                    for i in range(32)])
    print(f"{'128 prompts of 512, n = 1':40s} {distinct:10,.0f} tok/s  1.00x")
    print(f"{'32 prompts of 512, n = 4':40s} {shared:10,.0f} tok/s  {shared / distinct:.2f}x")


if __name__ == "__main__":
    main()
