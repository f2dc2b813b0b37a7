"""Where a decode step's time goes on CUDA: GPU graph replay vs host phases.

GPT-2 small (random weights, fp16), 128 running sequences. Run from the
repository root on a GPU machine:  python3 docs/bench/step_phases.py [tok]
(``tok`` gives the engine the GPT-2 tokenizer, so detokenization is timed too).
"""
import collections
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import roseinfer.core.runner as runner_mod
from roseinfer import LLM, SamplingParams
from roseinfer.models.loader import CACHE_DIR
from roseinfer.models.tokenizers import gpt2_tokenizer

torch.manual_seed(0)
hf = GPT2LMHeadModel(GPT2Config()).eval().half().cuda()
tok = gpt2_tokenizer(CACHE_DIR) if "tok" in sys.argv else None
eng = LLM(hf, tokenizer=tok, device="cuda", dtype="float16", enable_prefix_cache=False,
          max_num_seqs=128, num_kv_blocks=4096).engine
T = collections.defaultdict(float)


def timed(obj, name, key):
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[key] += time.perf_counter() - t
        return r
    setattr(obj, name, wrapper)


timed(eng.scheduler, "schedule", "schedule")
timed(eng.runner, "launch", "launch (build inputs, copy, graph launch, sample)")
timed(runner_mod, "fill", "  of which: build inputs")
timed(eng, "_collect", "collect (wait, append, detokenize, outputs)")
timed(runner_mod.LaunchedStep, "result", "  of which: wait for the GPU")
for i in range(128):
    eng.add_request(str(i), [15496] * (1 + 3 * (i % 2)),
                    SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
for _ in range(40):
    eng.step()
graph = eng.runner.graphs.graphs[(128, "triton_identity_pos")]
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(200):
    graph.replay()
torch.cuda.synchronize()
print(f"GPU: graph replay alone       {(time.perf_counter() - t) / 200 * 1e3:.3f} ms")
T.clear()
t, n = time.perf_counter(), 40
for _ in range(n):
    eng.step()
print(f"engine step, end to end      {(time.perf_counter() - t) / n * 1e3:.3f} ms")
for k, v in T.items():
    print(f"{k:48s} {v / n * 1e3:.3f} ms")
