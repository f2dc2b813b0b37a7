"""What a round of the mtp proposer costs, on random weights (issue 67): one sequence of
a random-weight DeepSeek-V3-architecture shape, prompt P, N new tokens, greedy, under
three engines in one process: CUDA graphs without drafts (what serving runs today),
eager steps without drafts (what mtp's steps run as), and mtp. Random MTP weights draft
nothing the model keeps, so the mtp row is its cost (rounds that lose) and the greedy
ids show exactness; with a trained module each round would keep about 0.85 drafts.

Usage: python3 docs/bench/mtp_round.py [--model moonlight-16b-a3b-random] [--prompt 512]
       [--new 128] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from roseinfer import LLM, SamplingParams

ROWS = {"graphs": dict(cuda_graphs=True), "eager": dict(cuda_graphs=False),
        "mtp": dict(speculative="mtp")}


def run(model: str, row: str, prompt: list[int], new: int, reps: int) -> dict:
    llm = LLM(model, dtype="bfloat16", max_num_seqs=8, max_model_len=2048, **ROWS[row])
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: kernels built, graphs captured
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    stats = llm.engine.stats()
    result = {"row": row, "s": times, "ms_per_token": [1e3 * t / new for t in times],
              "ids": out.token_ids, "drafts": stats.num_drafts,
              "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens}
    return result


def prompt(args) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, 30000, (args.prompt,), generator=g).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b-random")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--row", choices=ROWS, help="run this row alone and print its JSON")
    args = p.parse_args()
    if args.row:  # one engine a process: each starts from a device with nothing else on it
        print(json.dumps(run(args.model, args.row, prompt(args), args.new, args.reps)))
        return
    results = []
    for row in ROWS:
        out = subprocess.run([sys.executable, __file__, "--row", row, "--model", args.model,
                              "--prompt", str(args.prompt), "--new", str(args.new),
                              "--reps", str(args.reps)], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"row {row} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = results[1]["ids"]
    for r in results:
        same = next((i for i, (a, b) in enumerate(zip(r["ids"], base)) if a != b), None)
        print(f"{r['row']:7s} ms/token {' '.join(f'{x:.3f}' for x in r['ms_per_token'])}  "
              f"drafts {r['drafts']} ({r['accepted']} of {r['draft_tokens']} kept)  "
              f"ids vs eager: {'equal' if same is None else f'first differ at {same}'}")
    print(json.dumps([{k: v for k, v in r.items() if k != "ids"} for r in results]))


if __name__ == "__main__":
    main()
