"""Chats beside an embedding job on one engine pair (core/paired_engine.py, what `serve
--pooling-model` runs): the chats' TTFT and TPOT with the job queued against the same
chats alone, and the job's texts a second, the engine stepped here.

CHATS chat requests (random prompts of PROMPT tokens, NEW tokens each) arrive RATE a
second; with the job, JOB texts of 32-512 random tokens (64 a request, priority 5) are
queued first, as a corpus job sent to the backlog would be. One JSON line to
OUT/embed_beside_chat.jsonl per run: alone, then beside the job (two rounds each).

Usage: python3 docs/bench/embed_beside_chat.py [--model llama3-8b-random]
  [--pooling-model bge-large-random] [--chats 32] [--rate 2] [--prompt 512] [--new 128]
  [--job 10000] [--device cuda] [--dtype bfloat16]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from embeddings import SHAPES, build  # noqa: E402

from roseinfer import LLM, SamplingParams  # noqa: E402
from roseinfer.core.config import EngineConfig  # noqa: E402
from roseinfer.core.paired_engine import PairedEngine  # noqa: E402
from roseinfer.core.pooling_engine import PoolingEngine  # noqa: E402
from roseinfer.core.pooling_task import PoolingTask  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(pair: PairedEngine, args, with_job: bool, round_: int) -> dict:
    gen = torch.Generator().manual_seed(round_)
    vocab, words = pair.generator.vocab_size, pair.pooler.hf_config.vocab_size
    if with_job:  # token ids of the pooling model, [CLS] and [SEP] added within its 512
        for r in range(0, args.job, 64):
            texts = [torch.randint(5, words, (int(n),), generator=gen).tolist()
                     for n in torch.randint(32, 500, (min(64, args.job - r),), generator=gen)]
            task = PoolingTask("embed", texts, truncate="right")
            pair.add_request(f"job-{round_}-{r}", pair.prepare(task), SamplingParams(priority=5))
    due = [i / args.rate for i in range(args.chats)]
    jobs = [rid for rid in pair._pooled if rid.startswith(f"job-{round_}-")]
    sent, first, last, gaps, done = {}, {}, {}, [], 0
    jobs_done, start = 0, time.perf_counter()
    while len(sent) < args.chats or pair.has_unfinished():
        now = time.perf_counter() - start
        while len(sent) < args.chats and due[len(sent)] <= now:
            rid = f"chat-{round_}-{len(sent)}"
            pair.add_request(rid, torch.randint(10, vocab, (args.prompt,), generator=gen)
                             .tolist(), SamplingParams(max_tokens=args.new, temperature=0,
                                                       ignore_eos=True))
            sent[rid] = time.perf_counter()
        if not pair.has_unfinished():
            time.sleep(0.001)
            continue
        for out in pair.step():
            t = time.perf_counter()
            if out.request_id.startswith("job"):
                jobs_done += len(out.item_tokens)
                continue
            if out.new_token_ids:
                if out.request_id not in first:
                    first[out.request_id] = t - sent[out.request_id]
                else:
                    gaps.append((t - last[out.request_id]) / len(out.new_token_ids))
                last[out.request_id] = t
            done += out.finished
        if with_job and done == args.chats:
            break  # the chats' figures are in; the rest of the job is not timed
    seconds = time.perf_counter() - start
    for rid in jobs:
        pair.abort(rid)
    while pair.has_unfinished():  # the job's aborts reported: the next run starts empty
        pair.step()
    ttft = list(first.values())
    return {"job": with_job, "ttft_p50_ms": percentile(ttft, 0.5) * 1e3,
            "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
            "tpot_p50_ms": percentile(gaps, 0.5) * 1e3, "tpot_mean_ms": statistics.mean(gaps) * 1e3,
            "job_texts_done": int(jobs_done), "job_texts_per_s": jobs_done / seconds,
            "seconds": seconds}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b-random")
    p.add_argument("--pooling-model", default="bge-large-random",
                   help="a sentence-transformers directory, or bge-large-random (the BGE-large "
                        "shape saved by docs/bench/embeddings.py)")
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--job", type=int, default=10000)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--beside-tokens", type=int, default=512,
                   help="a pooling batch's tokens while chats decode")
    p.add_argument("--idle-tokens", type=int, default=None,
                   help="a pooling batch's tokens when no chat runs (default: a whole batch)")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    folder = args.pooling_model
    if folder == "bge-large-random":
        folder = build(Path(tempfile.mkdtemp()), SHAPES["bge-large"])
    pooler = PoolingEngine(folder, config=EngineConfig(device=args.device, dtype=args.dtype))
    pair = PairedEngine(llm.engine, pooler, args.beside_tokens, args.idle_tokens)
    run(pair, dataclass_copy(args, chats=4, job=256), True, 0)  # warm-up
    out = open(os.path.join(os.environ.get("OUT", "."), "embed_beside_chat.jsonl"), "a")
    rows = []
    for r in (1, 2):
        for job in (False, True):
            row = run(pair, args, job, r)
            rows.append(row)
            out.write(json.dumps({**vars(args), **row}) + "\n")
            out.flush()
            print(f"{'beside the job' if job else 'alone'}: TTFT p50 {row['ttft_p50_ms']:.1f} "
                  f"ms, p99 {row['ttft_p99_ms']:.1f} ms; TPOT p50 {row['tpot_p50_ms']:.2f} ms; "
                  f"job {row['job_texts_per_s']:.0f} texts/s", flush=True)
    alone = statistics.median(r["ttft_p50_ms"] for r in rows if not r["job"])
    beside = statistics.median(r["ttft_p50_ms"] for r in rows if r["job"])
    print(f"chat TTFT p50 beside the job / alone: {beside / alone:.3f} (target <= 1.2)")


def dataclass_copy(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    main()
