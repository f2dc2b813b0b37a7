"""Gated DeltaNet's recurrence on the GPU: flash-linear-attention's kernels against the
torch closed form (layers/gated_deltanet.py ``delta_rule``), on Qwen3-Next's head shapes
(16 key heads, 32 value heads of 128), bfloat16 inputs, float32 states.

Decode (one token a sequence, B sequences): the call's time against the bytes it must
move, the states read and written (32 x 128 x 128 float32, 2 MiB a sequence, each way)
at the copy rate measured first. Prompts (one sequence of T tokens): time and tokens a
second. Median of 20 calls after 3, each timed with events. One JSON line per row to
OUT/deltanet_kernels.jsonl.

    python3 docs/bench/deltanet_kernels.py [--decode 1,8,64,256] [--prompt 512,4096,32768]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from long_context_attention import copy_rate  # noqa: E402

from roseinfer.layers import gated_deltanet  # noqa: E402

NK, NV, DK, DV = 16, 32, 128, 128


def inputs(batch: int, tokens: int):
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + tokens)
    shape = batch, tokens
    q, k = (torch.randn(*shape, NK, DK, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    v = torch.randn(*shape, NV, DV, generator=gen, device="cuda").bfloat16()
    g = -torch.rand(*shape, NV, generator=gen, device="cuda")
    beta = torch.rand(*shape, NV, generator=gen, device="cuda")
    state = torch.randn(batch, NV, DK, DV, generator=gen, device="cuda") * 0.1
    return q, k, v, g, beta, state


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def run(kind: str, args) -> float:
    saved = gated_deltanet.kernels
    gated_deltanet.kernels = lambda device: kind
    try:
        return timed(lambda: gated_deltanet.delta_rule(*args[:5], args[5].clone()))
    finally:
        gated_deltanet.kernels = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", default="1,8,64,256")
    ap.add_argument("--prompt", default="512,4096,32768")
    args = ap.parse_args()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s", flush=True)
    out = open(os.path.join(os.environ.get("OUT", "."), "deltanet_kernels.jsonl"), "a")
    for batch in map(int, args.decode.split(",")):
        x = inputs(batch, 1)
        floor = 2 * x[5].numel() * 4 / rate  # states read and written
        for kind in ("fla", "torch"):
            s = run(kind, x)
            row = {"phase": "decode", "batch": batch, "kernels": kind, "us": s * 1e6,
                   "floor_us": floor * 1e6, "fraction": floor / s}
            out.write(json.dumps(row) + "\n")
            print(f"decode {batch:4d} seqs {kind:>5}: {s * 1e6:9.1f} us (floor {floor * 1e6:.1f} "
                  f"us: {floor / s:.0%})", flush=True)
    for tokens in map(int, args.prompt.split(",")):
        x = inputs(1, tokens)
        for kind in ("fla", "torch"):
            s = run(kind, x)
            row = {"phase": "prompt", "tokens": tokens, "kernels": kind, "ms": s * 1e3,
                   "tokens_per_s": tokens / s}
            out.write(json.dumps(row) + "\n")
            print(f"prompt {tokens:6d} tokens {kind:>5}: {s * 1e3:9.2f} ms "
                  f"({tokens / s:,.0f} tokens/s)", flush=True)


if __name__ == "__main__":
    main()
