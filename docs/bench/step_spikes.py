"""Long engine steps under arrivals, and what happened in them: a Triton
compile, a cudaMalloc (the caching allocator meeting a new size), a Python
garbage collection.

The latency issue's workload without Redis (Llama-3.2-1B shape, random bf16,
prompts of 256 / 512 / 768 random ids in turn, 128 new tokens, greedy, one
arrival every 20 ms of wall time, 200 requests), run twice in one engine: the
first run warms up, the second is recorded. For each step of the second run:
its wall time, Triton variants compiled, cudaMalloc calls, and milliseconds
spent in the garbage collector during it.
Eager mixed steps, then mixed graphs. Run from the repository root on a GPU:
    python3 docs/bench/step_spikes.py
"""
import gc
import time

import torch
from triton.runtime.jit import JITFunction

from roseinfer import LLM, SamplingParams

LONG_MS = 30.0


GC_MS = [0.0]
_gc_start = [0.0]


def _gc_timer(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        GC_MS[0] += (time.perf_counter() - _gc_start[0]) * 1e3


def counters(fns) -> tuple:
    """(Triton variants compiled, cudaMallocs so far, GC ms so far)."""
    return (sum(len(cache[0]) for f in fns for cache in f.device_caches.values()),
            torch.cuda.memory_stats().get("num_device_alloc", 0), GC_MS[0])


def run(eng, fns, tag: str, requests: int = 200, every_s: float = 0.02):
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    steps, added, start = [], 0, time.perf_counter()
    while added < requests or eng.has_unfinished():
        while added < requests and time.perf_counter() - start >= added * every_s:
            n = (256, 512, 768)[added % 3]
            eng.add_request(f"{tag}{added}", torch.randint(100, 100_000, (n,), generator=g).tolist(),
                            params)
            added += 1
        before = counters(fns)
        t = time.perf_counter()
        eng.step()
        ms = (time.perf_counter() - t) * 1e3
        steps.append((ms, *(b - a for a, b in zip(before, counters(fns)))))
    return steps


def main():
    print(torch.cuda.get_device_name())
    gc.callbacks.append(_gc_timer)
    for name, tokens in (("eager mixed steps", 0), ("mixed graphs", 4096)):
        llm = LLM("llama3-1b-random", device="cuda", dtype="bfloat16", max_num_seqs=128,
                  enable_prefix_cache=False, max_model_len=4096, mixed_graph_max_tokens=tokens)
        fns = [o for o in gc.get_objects() if isinstance(o, JITFunction)]
        run(llm.engine, fns, "warm")
        steps = run(llm.engine, fns, "run")
        times = sorted(s[0] for s in steps)
        total = [sum(s[i] for s in steps) for i in (1, 2)]
        print(f"{name}: {len(steps)} steps, p50 {times[len(times) // 2]:.1f} ms, "
              f"p99 {times[int(0.99 * len(times))]:.1f} ms, max {times[-1]:.1f} ms; "
              f"{total[0]} compiles and {total[1]} cudaMallocs in the run", flush=True)
        for ms, compiles, mallocs, gc_ms in steps:
            if ms > LONG_MS:
                print(f"  a {ms:.0f} ms step: {compiles} compiles, {mallocs} cudaMallocs, "
                      f"{gc_ms:.0f} ms in GC")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
