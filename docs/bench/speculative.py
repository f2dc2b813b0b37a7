"""Speculative decoding on against off, in one engine (off: every request asks
speculative=False), runs alternating after a warm-up of each.

Workloads the bench builds itself:
  repeat  repeat a passage with one word changed (the passages: sentences below,
          shuffled per prompt)
  edit    rename a variable in a function of Python's standard library, whole
  free    short stories on given topics: no repetition to find
  always  512 random prompt ids; with --proposer always (k random tokens every step)
          and --no-pause, each round is one verify step of k + 1 positions that keeps
          one token: off/on is the verify step's cost in plain steps (random weights)

Usage: python docs/bench/speculative.py --model SmolLM2-135M-Instruct --device cpu \
  --workloads repeat,free --batch 1 [--proposer ngram|draft|always] [--draft-model M] \
  [--num-speculative-tokens K] [--max-tokens 256] [--repeat-runs 3] [--no-pause] \
  [--disable-by-batch-size 8] [--output-json F]
"""
from __future__ import annotations

import argparse
import inspect
import json
import random
import subprocess
import textwrap
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core import speculation
from roseinfer.core.plugins import PluginRegistry
from roseinfer.core.speculation import Draft

SENTENCES = [
    "The river rose through the night, and by morning the low road was under water.",
    "The baker opened late, and the school did not open at all.",
    "Farmers moved their animals to the hill behind the old church.",
    "A boat from the next town carried bread, candles and news.",
    "By noon the rain stopped, and the water began to fall back.",
    "Children counted the marks it left on the walls of the mill.",
    "The mayor said the bridge would be rebuilt before the winter.",
    "Nobody believed him, but everyone helped to clear the mud.",
    "In the evening the square filled with people and lanterns.",
    "Someone played a violin, and the baker gave away the last loaves.",
]
SWAPS = [("river", "stream"), ("baker", "miller"), ("bridge", "dam"), ("rain", "storm"),
         ("boat", "barge"), ("mill", "barn"), ("mayor", "priest"), ("violin", "flute")]
TOPICS = ["a lighthouse keeper", "a lost map", "a robot learning to paint", "a city under ice",
          "two rival chefs", "a letter that arrives forty years late", "a talking crow",
          "the last train of the night"]
FUNCTIONS = [textwrap.dedent, textwrap.indent, json.dumps, random.Random.shuffle,
             inspect.getmembers, subprocess.list2cmdline, argparse.ArgumentParser.add_argument,
             textwrap.TextWrapper.wrap]


def prompts(workload: str, n: int) -> list:
    out = []
    for i in range(n):
        rng = random.Random(i)
        if workload == "always":
            out.append([rng.randrange(2, 32000) for _ in range(512)])
        elif workload == "repeat":
            old, new = SWAPS[i % len(SWAPS)]
            passage = " ".join(rng.sample(SENTENCES, 6))
            out.append(f"Repeat the following passage word for word, except that every "
                       f"'{old}' becomes '{new}':\n\n{passage}")
        elif workload == "edit":
            source = inspect.getsource(FUNCTIONS[i % len(FUNCTIONS)])
            out.append(f"Rewrite this Python function with the first argument renamed to "
                       f"'value'. Reply with the whole function only.\n\n{source}")
        else:
            out.append(f"Write a short story about {TOPICS[i % len(TOPICS)]}.")
    return out


class Always:
    """Drafts k random tokens at every step."""

    def __init__(self, ctx):
        self.vocab, self.rng = ctx.vocab_size, random.Random(0)

    def propose(self, token_ids, room):
        return [Draft([self.rng.randrange(self.vocab) for _ in range(n)]) for n in room]


class BenchProposers:
    @hookimpl
    def roseinfer_register_proposers(self, register):
        register("always", Always)


def run(llm, texts, args, speculative: bool) -> dict:
    spec = llm.engine.speculator
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, speculative=speculative,
                            ignore_eos=args.ignore_eos)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = []
    for at in range(0, len(texts), args.batch):
        ids += [o.token_ids for o in llm.generate(texts[at:at + args.batch], params)]
    tokens = sum(map(len, ids))
    seconds = time.perf_counter() - start
    drafts, drafted, accepted = (a - b for a, b in zip(
        (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), before))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "drafts": drafts,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": 1 + accepted / drafts if drafts else None,
            "ids": ids}


def _agreement(off: list[list[int]], on: list[list[int]]) -> dict:
    """How many outputs are the same, and where the others first differ."""
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(off, on) if x != y]
    return {"outputs": len(off), "equal": len(off) - len(firsts), "first_difference": firsts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workloads", default="repeat,edit,free")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--proposer", default="ngram")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k (default: the engine's, 8 on CUDA and 4 on the CPU)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repeat-runs", type=int, default=3)
    p.add_argument("--no-pause", action="store_true",
                   help="requests never pause their drafts (to time verify steps)")
    p.add_argument("--disable-by-batch-size", type=int, default=8)
    p.add_argument("--cpu-compiled-step", default="off")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.no_pause:
        speculation.MIN_ROUNDS = 1 << 30
    plugins = PluginRegistry()
    plugins.register(BenchProposers(), name="bench-proposers")
    llm = LLM(args.model, plugins=plugins, device=args.device, dtype=args.dtype,
              speculative=args.proposer, draft_model=args.draft_model,
              num_speculative_tokens=args.num_speculative_tokens,
              speculative_disable_by_batch_size=args.disable_by_batch_size,
              max_num_seqs=max(8, args.batch), max_model_len=args.max_model_len,
              cpu_compiled_step=args.cpu_compiled_step, enable_prefix_cache=False)
    report = {"args": vars(args), "workloads": {}, "engine": {}}
    for workload in args.workloads.split(","):
        texts = prompts(workload, args.num_prompts)
        if workload != "always":
            texts = [llm.engine.chat_prompt(t) for t in texts]
        runs = {"off": [], "on": []}
        for speculative in (False, True):  # warm-up
            run(llm, texts[:args.batch], args, speculative)
        for _ in range(args.repeat_runs):
            for name, speculative in (("off", False), ("on", True)):
                runs[name].append(run(llm, texts, args, speculative))
        same = _agreement(runs["off"][0]["ids"], runs["on"][0]["ids"])
        for r in runs["off"] + runs["on"]:
            r.pop("ids")
        off = sum(r["tok_s"] for r in runs["off"]) / len(runs["off"])
        on = sum(r["tok_s"] for r in runs["on"]) / len(runs["on"])
        on_runs = runs["on"]
        accepted = sum(r["accepted_tokens"] for r in on_runs)
        drafted = sum(r["draft_tokens"] for r in on_runs)
        drafts = sum(r["drafts"] for r in on_runs)
        report["workloads"][workload] = {
            "off_tok_s": off, "on_tok_s": on, "speedup": on / off, "same_outputs": same,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": 1 + accepted / drafts if drafts else None,
            "tokens": on_runs[0]["tokens"], "runs": runs}
        print(f"{workload}: off {off:.1f} tok/s, on {on:.1f} tok/s, {on / off:.2f}x; "
              f"acceptance {report['workloads'][workload]['acceptance']}, tokens per round "
              f"{report['workloads'][workload]['tokens_per_round']}; greedy outputs equal: "
              f"{same['equal']} of {same['outputs']}, first differences at "
              f"{same['first_difference']}",
              flush=True)
    spec = llm.engine.speculator
    report["engine"] = {"plain_step_s": spec.plain_s, "verify_step_s": spec.verify_s}
    print(f"running means: plain step {spec.plain_s}, verify step {spec.verify_s}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
