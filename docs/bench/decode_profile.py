"""Where a decode step of a real shape spends its time, on CUDA.

For each model and batch, once every prompt is in the cache: the engine's
wall time per decode step (host and GPU overlapped; a decode window counts as
its steps), the GPU's busy time per step, and every kernel with its time per
step (torch.profiler sees the kernels a CUDA graph launches), against the
bytes a step must read (weights once, each sequence's K/V) at PEAK_TB_S
(default 3.0) TB/s. With tensor parallelism (TP > 1) the figures are rank 0's
(its shards' bytes, its kernels), and the all-reduces' share of the step is
printed. KV_CACHE_DTYPE=fp8 profiles over an FP8 K/V cache; QUANTIZATION=fp8 (or another
method) quantizes the weights at load. SKINNY_ROWS=16 puts every 16-bit linear on the
skinny kernel up to that many rows instead of timing it against cuBLAS at load.

    [PEAK_TB_S=4.5] [KV_CACHE_DTYPE=fp8] [QUANTIZATION=fp8] [SKINNY_ROWS=16] python3 docs/bench/decode_profile.py MODEL:BATCH[:CONTEXT[:TP]] ...
    e.g. llama3-1b-random:1 llama3-8b-random:1 llama3-1b-random:256:600
"""
import collections
import gc
import os
import sys
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.bench.floor import PEAK_BYTES_PER_S, kv_bytes_read, routed_bytes, weight_bytes

PEAK = float(os.environ.get("PEAK_TB_S", PEAK_BYTES_PER_S / 1e12)) * 1e12


def steps(eng, n: int) -> int:
    """Run ``n`` engine steps; returns the tokens they produced."""
    return sum(len(out.new_token_ids) for _ in range(n) for out in eng.step())


def kernel_table(eng, n: int):
    """Kernels of ``n`` engine steps: (name, calls, summed us), and the tokens made."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tokens = steps(eng, n)
        torch.cuda.synchronize()
    total = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            total[ev.name][0] += 1
            total[ev.name][1] += ev.device_time_total
    return sorted(((k, c, us) for k, (c, us) in total.items()), key=lambda r: -r[2]), tokens


def profile(model: str, batch: int, context: int = 512, tp: int = 1) -> None:
    llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=batch,
              # room for every token the profile makes: at 32 sequences and more a step
              # decodes a window of 8 (engine.decode_steps), 70 steps 560 tokens
              enable_prefix_cache=False, max_model_len=context + 2048,
              tensor_parallel_size=tp, kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"),
              quantization=os.environ.get("QUANTIZATION") or None)
    eng = llm.engine
    weights = weight_bytes(eng.model)
    for i in range(batch):
        eng.add_request(str(i), [(7 * i + j) % 1000 + 1 for j in range(context)],
                        SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t
    steps(eng, 10)
    context_at = [sum(len(s.token_ids) for s in eng.seqs.values()) / batch]
    torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = steps(eng, 40)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / (tokens / batch)
    rows, profiled = kernel_table(eng, 20)
    context_at.append(sum(len(s.token_ids) for s in eng.seqs.values()) / batch)
    # K/V of one step at the mean context (each window layer's window); the experts a
    # step of `batch` tokens chooses
    kv = batch * kv_bytes_read(eng, [int(sum(context_at) / 2)], [1])
    weights += routed_bytes(eng.model, batch)
    floor = (weights + kv) / PEAK
    n = profiled / batch  # decode steps profiled
    gpu = sum(us for _, _, us in rows) / n / 1e6
    print(f"\n== {model} TP {tp} batch {batch}, context {context_at[0]:.0f}-{context_at[1]:.0f}: weights {weights / 1e9:.2f} GB, "
          f"K/V read {kv / 1e9:.3f} GB, floor {floor * 1e3:.3f} ms per decode step")
    print(f"prefill of {batch} x {context} tokens {prefill_s:.3f} s; "
          f"decode step {per_step * 1e3:.3f} ms ({floor / per_step:.0%} of floor); "
          f"GPU busy {gpu * 1e3:.3f} ms of it ({floor / gpu:.0%}); "
          f"{sum(c for _, c, _ in rows) / n:.0f} kernels per step")
    nccl = sum(us for name, _, us in rows
               if any(s in name.lower() for s in ("nccl", "all_reduce", "one_shot"))) / n / 1e6
    if tp > 1:
        print(f"all-reduce and gather kernels {nccl * 1e3:.3f} ms per step "
              f"({nccl / per_step:.0%} of the step)")
    for name, count, us in rows[:25]:
        print(f"  {us / n:9.1f} us/step {count / n:6.1f}x  {us / count:7.2f} us each  {name[:100]}")
    kv_dtype = str(eng.kv_cache.k[0].dtype).removeprefix("torch.")
    llm.engine.close()
    return {"model": model, "batch": batch, "context": context, "tp": tp, "prefill_s": prefill_s,
            "kv_cache": kv_dtype,
            "step_ms": per_step * 1e3, "floor_ms": floor * 1e3, "fraction": floor / per_step,
            "attention_ms": sum(us for name, _, us in rows if name.startswith(
                ("_paged_decode_kernel", "_merge_splits_kernel"))) / n / 1e3, "kernels_per_step": sum(c for _, c, _ in rows) / n}


if __name__ == "__main__":
    if os.environ.get("SKINNY_ROWS"):
        from roseinfer.layers import skinny_linear
        skinny_linear.skinny_rows = lambda linears: (int(os.environ["SKINNY_ROWS"]), 1)
    for spec in sys.argv[1:] or ["llama3-1b-random:1"]:
        model, batch, *rest = spec.split(":")
        profile(model, int(batch), *map(int, rest))
        gc.collect()
        torch.cuda.empty_cache()
