"""The compiled CPU step built in the background (core/cpu_step.py), as a fresh start
meets it: the default model, batch 1. In one run:

0. the first answer of a 32-token request alone, builds off then on, ``--pairs`` times
   (each from a cache with no build);
1. background builds off (the start before this change): the time to the first answer,
   then eager decoding speed, three requests back to back;
2. a cache with no build (the converted model and linear timings copied from the real
   cache, no cpu_steps): the first answer's time, three requests back to back while the
   child builds, then no requests until the build ends (the time since the start is
   printed), then three requests again, once it is swapped in;
3. transformers' greedy generate at batch 1, the baseline.

    python3 docs/bench/background_build.py [--tokens 64]
"""
import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, os, sys, time
t0 = time.perf_counter()
from roseinfer import LLM, SamplingParams
tokens = int(sys.argv[1]); until_swap = sys.argv[2] == "1"; first_only = sys.argv[2] == "first"
llm = LLM("SmolLM2-135M-Instruct")
prompt = llm.tokenizer.encode("Write a short story about a lighthouse keeper.")
first = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
rows = [{"first_answer_s": round(time.perf_counter() - t0, 2)}]
engine = llm.engine
if first_only:
    if engine._background is not None:
        engine._background.proc.kill()
    print(json.dumps(rows))
    sys.exit(0)
def rate():
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return tokens / (time.perf_counter() - t)
def row(note):
    rows.append({"tok_s": round(rate(), 1), "step": engine.step_kind, "note": note,
                 "t": round(time.perf_counter() - t0, 1)})
for _ in range(3):
    row("back to back, the build running" if engine.step_kind == "building" else "")
if until_swap and engine._background is not None:
    while not engine._background.done():  # idle: the build takes the cores
        time.sleep(0.2)
    rows.append({"build_ended_s": round(time.perf_counter() - t0, 1)})
    for _ in range(3):
        row("after the build")
print(json.dumps(rows))

'''


def run(env, tokens, mode):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), mode],
                         env=env, capture_output=True, text=True, check=True)
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def fresh_cache(real):
    """A cache directory holding the real one's converted model and linear timings, no
    compiled steps."""
    with tempfile.TemporaryDirectory() as fresh:
        for name in os.listdir(real):
            if name != "cpu_steps":
                src = os.path.join(real, name)
                (shutil.copytree if os.path.isdir(src) else shutil.copy)(
                    src, os.path.join(fresh, name))
        yield fresh


def on_env(fresh):
    env = {**os.environ, "ROSEINFER_CACHE": fresh}
    env.pop("ROSEINFER_BACKGROUND_BUILDS", None)
    return env


def hf_rate(tokens):
    import torch
    from roseinfer.models import loader
    model, tok = loader.hf_model("SmolLM2-135M-Instruct")
    ids = torch.tensor([tok.encode("Write a short story about a lighthouse keeper.")])
    model.generate(ids, max_new_tokens=8, do_sample=False)
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                   min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    real = os.environ.get("ROSEINFER_CACHE", os.path.expanduser("~/.cache/roseinfer"))
    off_env = {**os.environ, "ROSEINFER_BACKGROUND_BUILDS": "0"}
    for _ in range(args.pairs):  # the first answer alone, alternated: off, then on
        with fresh_cache(real) as fresh:
            firsts = [run({**off_env, "ROSEINFER_CACHE": fresh}, args.tokens, "first"),
                      run(on_env(fresh), args.tokens, "first")]
        print("first answer, builds off / on:", [f[0]["first_answer_s"] for f in firsts])
    off = run(off_env, args.tokens, "0")
    print("background builds off:", off)
    with fresh_cache(real) as fresh:
        on = run(on_env(fresh), args.tokens, "1")
        print("fresh cache, building in the background:", on)
        steps = os.path.join(fresh, "cpu_steps")
        for f in sorted(os.listdir(steps)) if os.path.isdir(steps) else []:
            if f.endswith(".json"):
                print("record:", open(os.path.join(steps, f)).read().replace("\n", " "))
    print(f"transformers generate, batch 1: {hf_rate(args.tokens):.1f} tok/s")


if __name__ == "__main__":
    main()
