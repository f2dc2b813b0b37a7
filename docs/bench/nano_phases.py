"""Where the nano-vllm-shape run's time goes (Llama-1B shape, 256 requests, prompts and
outputs uniform in 100-1024, temperature 0.6): per launched batch, its GPU time (CUDA
events around the launch) and its rows; summed over the steps that carry prefill and
over the decode steps by batch size, against each decode step's bytes floor. Then a
kernel profile of 10 engine steps at full batch.

    python3 docs/bench/nano_phases.py [temperature=T] [ENGINE_OPTION=INT ...]
    e.g. max_num_batched_tokens=16384
"""
import collections
import random
import sys
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.bench.floor import kv_bytes_per_token, weight_bytes
from roseinfer.bench.workloads import random_lengths

PEAK = 3.0e12
BUCKETS = (256, 192, 128, 64, 32, 16, 8, 4, 1)  # decode steps grouped by rows, at least


class Launches:
    """Wraps the runner's launch: CUDA events around each launch, and the batch's shape."""

    def __init__(self, runner):
        self.runner, self.launch, self.records = runner, runner.launch, []
        runner.launch = self

    def __call__(self, batch, previous=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        context = sum(s.num_computed for s in batch.seqs)
        prefill = sum(n for n in batch.num_tokens if n > 1)
        start.record()
        launched = self.launch(batch, previous)
        end.record()
        self.records.append((start, end, len(batch.seqs), prefill, batch.steps, context))
        return launched


def add_workload(eng, prompts, outputs, temperature, tag):
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=n, temperature=temperature,
                                                        ignore_eos=True))


def run(eng, prompts, outputs, temperature, tag) -> tuple[float, int]:
    add_workload(eng, prompts, outputs, temperature, tag)
    start, tokens = time.perf_counter(), 0
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def phases(records, weights, kv_token) -> None:
    """Seconds of GPU time per kind of step, and each decode bucket's floor."""
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    for start, end, rows, prefill, steps, context in records:
        seconds = start.elapsed_time(end) / 1e3
        if prefill:
            key, floor = "with prefill", 0.0
        else:
            key = "decode rows>=%d" % next(k for k in BUCKETS if rows >= k)
            kv = steps * context + rows * steps * (steps + 1) / 2  # tokens read
            floor = (steps * weights + kv * kv_token) / PEAK
        for i, v in enumerate((steps, seconds, floor, rows * steps, prefill)):
            agg[key][i] += v
    print(f"GPU time in launches {sum(v[1] for v in agg.values()):.3f} s")
    for key, (steps, seconds, floor, tokens, prefill) in agg.items():
        extra = f"prefill tokens {prefill}" if prefill else \
            f"floor {floor:.3f} s ({floor / seconds:.0%})"
        print(f"  {key:18s} steps {steps:5d} time {seconds:.3f} s tokens {tokens:6d} {extra}")


def kernel_profile(eng, launches, prompts, outputs, temperature, weights, kv_token) -> None:
    """Kernels of 10 engine steps once every prompt of the workload is in."""
    from torch.profiler import ProfilerActivity, profile
    add_workload(eng, prompts, outputs, temperature, "profiled")
    while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    rows = len(eng.scheduler.running)
    context = sum(s.num_computed for s in eng.seqs.values())
    launches.records.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    steps = sum(r[4] for r in launches.records)
    total = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            total[ev.name][0] += 1
            total[ev.name][1] += ev.device_time_total
    gpu = sum(v[1] for v in total.values()) / steps
    print(f"profile: {rows} rows, mean context {context / rows:.0f}, {steps} decode steps, "
          f"GPU {gpu / 1e3:.3f} ms/step, K/V {context * kv_token / 1e9:.2f} GB and weights "
          f"{weights / 1e9:.2f} GB per step")
    for name, (calls, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {us / steps:8.1f} us/step {calls / steps:5.1f} calls  {name[:90]}")
    while eng.has_unfinished():
        eng.step()


def main() -> None:
    options = dict(a.split("=") for a in sys.argv[1:])
    temperature = float(options.pop("temperature", 0.6))
    eng = LLM("llama3-1b-random", device="cuda", dtype="bfloat16", max_num_seqs=256,
              enable_prefix_cache=False, max_model_len=4096,
              **{k: int(v) for k, v in options.items()}).engine
    weights, kv_token = weight_bytes(eng.model), kv_bytes_per_token(eng.kv_cache)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(k)]
               for k in random_lengths(256, 562, 0.822, rng)]
    outputs = random_lengths(256, 562, 0.822, rng)
    launches = Launches(eng.runner)
    run(eng, prompts, outputs, temperature, "warm-up")
    launches.records.clear()
    wall, tokens = run(eng, prompts, outputs, temperature, "timed")
    print(f"{options} temperature {temperature}: {wall:.3f} s, {tokens} tokens, "
          f"{tokens / wall:.0f} tok/s, {len(launches.records)} launches")
    phases(launches.records, weights, kv_token)
    kernel_profile(eng, launches, prompts, outputs, temperature, weights, kv_token)


if __name__ == "__main__":
    main()
