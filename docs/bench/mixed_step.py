"""What one mixed step costs: decode rows plus one prefill chunk, launched
eagerly or replayed as a CUDA graph, against a decode-only step.

Llama-3.2-1B shape (random bf16 weights), 96 sequences decoding at ~600
tokens of context, then steps that each also prefill one new prompt of
``--chunk`` tokens. Each step is timed alone (synchronized before and after),
so the figure is host time plus GPU time of that step, nothing overlapped
(in serving, the host builds step n+1 while the GPU runs step n).
Run from the repository root on a GPU machine:
    python3 docs/bench/mixed_step.py [--chunk 512] [--decoders 96]
"""
import argparse
import statistics
import time

import torch

from roseinfer import LLM, SamplingParams


def synced_step(eng) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def measure(mixed_tokens: int, args) -> dict:
    llm = LLM("llama3-1b-random", device="cuda", dtype="bfloat16", max_num_seqs=128,
              enable_prefix_cache=False, decode_steps=1, max_model_len=4096,
              mixed_graph_max_tokens=mixed_tokens)
    eng = llm.engine
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(100, 100_000, (n,), generator=g).tolist()  # noqa: E731
    for i in range(args.decoders):
        eng.add_request(f"d{i}", prompt(512), params)
    for _ in range(100):  # prefill (4096 tokens a step), then contexts grow to ~600
        eng.step()
    decode = [synced_step(eng) for _ in range(30)]
    mixed = []
    for i in range(args.steps):
        eng.add_request(f"p{i}", prompt(args.chunk), SamplingParams(max_tokens=1))
        mixed.append(synced_step(eng))
        eng.step()  # the new request's token and finish; not timed
    out = {"decode_ms": statistics.median(decode), "mixed_ms": statistics.median(mixed),
           "mixed_p90_ms": sorted(mixed)[int(0.9 * len(mixed))]}
    del llm, eng
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--decoders", type=int, default=96)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), f"chunk {args.chunk}, {args.decoders} decoders")
    for name, tokens in (("mixed graphs", 4096), ("eager mixed steps", 0)):
        r = measure(tokens, args)
        print(f"{name:18s} " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
