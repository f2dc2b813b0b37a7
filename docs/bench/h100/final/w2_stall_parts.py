"""W2 repeated in LLM.generate: in a slow run, which part of a step is slow (wall / thread CPU ms), and
whether the thread was switched out, faulted or stole time. python3 w2_stall_parts.py greedy|topp RUNS"""
import gc, sys, time, statistics as st
from collections import defaultdict
import torch
from roseinfer import LLM, SamplingParams
kind = sys.argv[1]
llm = LLM("gpt2-random", dtype="float16", enable_prefix_cache=False, max_num_seqs=128)
eng = llm.engine
hello = eng.tokenizer.encode("Hello")
prompts = [hello * (1 if i % 2 == 0 else 4) for i in range(128)]
params = SamplingParams(max_tokens=128, ignore_eos=True,
                        **({"temperature": 0.7, "top_p": 0.9} if kind == "topp" else {"temperature": 0}))
rec = []  # per step: {part: (wall, cpu)}
cur = {}
def wrap(obj, attr, part):
    f = getattr(obj, attr)
    def w(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try: return f(*a, **k)
        finally:
            w0, c0 = cur.get(part, (0.0, 0.0))
            cur[part] = (w0 + time.perf_counter() - t, c0 + time.thread_time() - c)
    setattr(obj, attr, w)
wrap(eng.scheduler, "schedule", "schedule")
wrap(eng.runner, "launch", "launch")
wrap(eng, "_collect", "collect")
orig = eng.step
def step():
    cur.clear()
    t, c = time.perf_counter(), time.thread_time()
    out = orig()
    cur["step"] = (time.perf_counter() - t, time.thread_time() - c)
    rec.append(dict(cur)); return out
eng.step = step
minor = lambda: __import__("resource").getrusage(__import__("resource").RUSAGE_THREAD)
runs = []
def steal():
    with open("/proc/stat") as f:
        v = f.readline().split()
    return int(v[8])  # cpu: user nice system idle iowait irq softirq steal
import os
print("USER_HZ", os.sysconf("SC_CLK_TCK"))
for r in range(int(sys.argv[2])):
    rec.clear(); ru0 = minor(); st0 = steal()
    t0 = time.perf_counter(); outs = llm.generate(prompts, params); dt = time.perf_counter() - t0
    ru1 = minor(); st1 = steal()
    n = sum(len(o.token_ids) for o in outs)
    runs.append((n / dt, list(rec), ru1.ru_minflt - ru0.ru_minflt, ru1.ru_nivcsw - ru0.ru_nivcsw, ru1.ru_nvcsw - ru0.ru_nvcsw, st1 - st0))
med = st.median(r[0] for r in runs[1:])
print(f"{kind}: median {med:,.0f} tok/s, min {min(r[0] for r in runs[1:]):,.0f}")
shown = 0
print('steal ticks per run (all CPUs): slow', [r[5] for r in runs[1:] if r[0] < 0.9 * med], 'normal sum', sum(r[5] for r in runs[1:] if r[0] >= 0.9 * med), 'over', sum(1 for r in runs[1:] if r[0] >= 0.9 * med), 'runs')
for i, (tps, steps, flt, ivcs, vcs, stl) in enumerate(runs):
    slow = tps < 0.9 * med
    if not slow and i not in (3,): continue
    print(f"run {i} {tps:,.0f} tok/s minor faults {flt} involuntary switches {ivcs} voluntary {vcs} {'SLOW' if slow else 'normal'}")
    for k, s in enumerate(steps):
        if s["step"][0] > 0.008 or not slow:
            print("   step %2d " % k + " ".join(f"{p} {w*1e3:.2f}/{c*1e3:.2f}" for p, (w, c) in s.items()))
            if not slow and k > 4: break
    shown += 1
    if shown > 6: break
