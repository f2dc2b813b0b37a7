"""A fleet of `roseinfer worker` processes on one Redis, routing on against off.

Workloads (token ids, so any model works, random weights included):
- chat: C conversations of T turns over a shared system prompt; each turn adds a user
  message of U tokens (a range) and the answer of A tokens; a conversation sends its next
  turn when the previous one finished. Measures the fleet-wide prefix-cache hit rate
  (usage.cached_tokens / prompt tokens), TTFT and throughput.
- burst: C conversations, each with its own opening of S tokens, T turns; every turn all
  conversations submit at once and the next turn starts when all have answered. The hit
  rate of turns 2.. (`hit_rate_later`) is what routing keeps of one worker's.
- random: R prompts with nothing shared, P tokens each, sent at --rate per second.
- priority: a low-priority batch (--batch requests, priority 10) submitted at once, and
  interactive requests (priority 0) at --rate per second; the interactive TTFT against the
  same requests on an idle fleet.

Runs: `--runs 1:off 4:off 4:on 4:prefix` (workers:routing: off, on by predicted TTFT, or
on by the prefix rule alone); each starts its workers, warms them up, runs the workload,
stops them. Usage (the repository root on PYTHONPATH):
  python3 docs/bench/fleet_routing.py --workload chat --model gpt2-random --device cpu \
      --runs 1:off 2:off 2:on --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid

import msgpack
import redis.asyncio as aioredis

from roseinfer.frontends.redis_streams.client import AsyncClient
from roseinfer.frontends.redis_streams.protocol import Keys
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["chat", "burst", "random", "priority"],
                   default="chat")
    p.add_argument("--runs", nargs="+", default=["1:off", "4:off", "4:on"],
                   help="WORKERS:off|on|prefix, run in this order")
    p.add_argument("--model", default="gpt2-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--worker-flags", default="", help="more flags for every worker")
    p.add_argument("--vocab", type=int, default=50000, help="token ids are drawn below this")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", default="100-300", help="a turn's user message, MIN-MAX")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="random and priority workloads")
    p.add_argument("--prompt-tokens", type=int, default=512, help="random workload")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (random, interactive)")
    p.add_argument("--batch", type=int, default=1024, help="priority: low-priority requests")
    p.add_argument("--batch-tokens", type=int, default=256, help="priority: each one's tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the results' JSON goes here")
    p.add_argument("--logs", default=None, help="the workers' logs go here (default: --out)")
    return p.parse_args()


class Fleet:
    """Worker processes on one prefix; stopped (SIGTERM, then killed) on exit."""

    def __init__(self, args, url: str, workers: int, route: str):
        self.prefix = f"fleet-{uuid.uuid4().hex[:6]}"
        self.procs, self.logs = [], []
        cpu = args.device == "cpu"
        threads = max(1, (os.cpu_count() or 1) // workers) if cpu else None
        for i in range(workers):
            cmd = [sys.executable, "-m", "roseinfer.cli", "worker", "--redis-url", url,
                   "--prefix", self.prefix, "--consumer", f"w{i}", "--model", args.model,
                   "--device", args.device, "--raw", *args.worker_flags.split()]
            cmd += ["--dtype", args.dtype] if args.dtype else []
            cmd += {"off": ["--no-route"], "on": [],
                    "prefix": ["--route-policy", "prefix"]}[route]
            env = dict(os.environ)
            if cpu:
                env["OMP_NUM_THREADS"] = str(threads)
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            log = open(os.path.join(args.logs or args.out, f"{self.prefix}-w{i}.log"), "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

    def wait_started(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for proc, log in zip(self.procs, self.logs):
            while "event=started" not in open(log.name).read():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"a worker did not start; see {log.name}")
                time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.close()

    def routed(self) -> int:
        return sum(open(log.name).read().count("event=routed") for log in self.logs)

    def admissions(self) -> dict[str, tuple[float, bool]]:
        """rid -> (seconds from its XADD to its engine, whether a peer handed it over),
        from the workers' event=admitted and event=routed lines."""
        text = "".join(open(log.name).read() for log in self.logs)
        routed = set(re.findall(r"event=routed entry=(\S+)", text))
        return {rid: (float(queue_s), entry in routed) for rid, entry, queue_s in
                re.findall(r"event=admitted rid=(\S+) entry=(\S+) queue_s=(\S+)", text)}


async def one(client: AsyncClient, prompt: list[int], max_tokens: int, **params) -> dict:
    sent = time.monotonic()
    rid = await client.submit(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                              **params)
    ttft, ids, usage = None, [], None
    async for chunk in client.stream(rid, timeout=3600):
        if chunk.token_ids and ttft is None:
            ttft = time.monotonic() - sent
        ids += chunk.token_ids
        usage = chunk.usage or usage
    return {"rid": rid, "ttft": ttft, "e2e": time.monotonic() - sent, "ids": ids, "sent": sent,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage.get("cached_tokens", 0)}


def ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def chat(client: AsyncClient, args, rng: random.Random) -> list[dict]:
    system = ids(rng, args.vocab, args.system_tokens)
    lo, hi = map(int, args.user_tokens.split("-"))
    plans = [[ids(rng, args.vocab, rng.randint(lo, hi)) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    starts = [rng.uniform(0, 2.0) for _ in plans]  # conversations begin within 2 s

    async def conversation(turns: list[list[int]], start: float) -> list[dict]:
        await asyncio.sleep(start)
        history, out = list(system), []
        for t, user in enumerate(turns):
            history += user
            r = await one(client, history, args.answer_tokens)
            r["turn"] = t
            history += r["ids"]
            out.append(r)
        return out

    done = await asyncio.gather(*(conversation(p, s) for p, s in zip(plans, starts)))
    return [r for conv in done for r in conv]


async def burst(client: AsyncClient, args, rng: random.Random) -> list[dict]:
    lo, hi = map(int, args.user_tokens.split("-"))
    histories = [ids(rng, args.vocab, args.system_tokens) for _ in range(args.conversations)]
    out = []
    for t in range(args.turns):
        for h in histories:
            h += ids(rng, args.vocab, rng.randint(lo, hi))
        done = await asyncio.gather(*(one(client, list(h), args.answer_tokens)
                                      for h in histories))
        for h, r in zip(histories, done):
            h += r["ids"]
            r["turn"] = t
            out.append(r)
    return out


async def at_rate(client: AsyncClient, prompts: list[list[int]], rate: float,
                  max_tokens: int, **params) -> list[dict]:
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(client, prompt, max_tokens, **params)))
        await asyncio.sleep(1 / rate)
    return list(await asyncio.gather(*tasks))


async def random_prompts(client, args, rng) -> list[dict]:
    prompts = [ids(rng, args.vocab, args.prompt_tokens) for _ in range(args.requests)]
    return await at_rate(client, prompts, args.rate, args.answer_tokens)


async def priority(client, args, rng) -> dict:
    """Interactive requests on the idle fleet, then the same number beside a low-priority
    batch (into the backlog, not streamed here: only the interactive replies are read)."""
    interactive = [ids(rng, args.vocab, args.prompt_tokens) for _ in range(args.requests)]
    idle = await at_rate(client, interactive, args.rate, args.answer_tokens)
    started = time.monotonic()
    for _ in range(args.batch):
        await client.submit(ids(rng, args.vocab, args.prompt_tokens), max_tokens=args.batch_tokens,
                            temperature=0, ignore_eos=True, priority=10)
    await asyncio.sleep(5)  # the batch fills every worker first
    interactive = [ids(rng, args.vocab, args.prompt_tokens) for _ in range(args.requests)]
    busy = await at_rate(client, interactive, args.rate, args.answer_tokens)
    left = await client.redis.xlen(client.keys.backlog)  # > 0: saturated all along
    while await client.redis.xlen(client.keys.backlog) or await client.redis.xlen(
            client.keys.requests):
        await asyncio.sleep(0.5)
    return {"idle": idle, "busy": busy, "batch_left_after_interactive": left,
            "batch_s": time.monotonic() - started}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def hit_rate(results: list[dict]) -> float:
    prompt = sum(r["prompt_tokens"] for r in results)
    return sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0


def summary(results: list[dict], wall: float, admissions: dict) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    later = [r for r in results if r.get("turn", 0) >= 1]
    return {"requests": len(results), "hit_rate": hit_rate(results),
            "hit_rate_later": hit_rate(later),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "req_per_s": len(results) / wall,
            "completion_tok_per_s": sum(len(r["ids"]) for r in results) / wall, "wall_s": wall,
            **ttft_parts(results, admissions)}


def ttft_parts(results: list[dict], admissions: dict) -> dict:
    """TTFT p50 split at admission: queue (XADD to the serving worker's engine, a routing
    hand-over included) and engine (the rest: waiting for a step, prefill, the reply's way
    back), for the requests served where they were read and for those handed over."""
    parts = {}
    for kind, routed in (("direct", False), ("routed", True)):
        rows = [(r["ttft"], admissions[r["rid"]][0]) for r in results
                if admissions.get(r["rid"], (0, None))[1] is routed]
        parts[kind] = {"requests": len(rows),
                       "ttft_p50_ms": 1000 * pct([t for t, _ in rows], 0.5),
                       "queue_p50_ms": 1000 * pct([q for _, q in rows], 0.5),
                       "engine_p50_ms": 1000 * pct([t - q for t, q in rows], 0.5)}
    return parts


async def forecasts(url: str, prefix: str, workers: int, stop: asyncio.Event) -> dict:
    """What the workers' routers read while the workload ran: each worker's reported
    decode step time and prefill rate (its load's forecast), sampled every 0.1 s, median
    per worker."""
    keys, seen = Keys(prefix), {f"w{i}": [] for i in range(workers)}
    r = aioredis.from_url(url)
    try:
        while not stop.is_set():
            for name, got in seen.items():
                raw = await r.get(keys.load(name))
                body = msgpack.unpackb(raw).get("forecast") if raw else None
                if body:
                    got.append(body[3:5])
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()
    return {name: {"samples": len(got), "step_ms_p50": 1000 * pct([g[0] for g in got], 0.5),
                   "prefill_tok_per_s_p50": pct([g[1] for g in got], 0.5)}
            for name, got in seen.items() if got}


async def run(args, url: str, workers: int, route: str) -> dict:
    fleet = Fleet(args, url, workers, route)
    try:
        fleet.wait_started()
        async with AsyncClient(url, fleet.prefix, max_connections=64) as client:
            warm = random.Random(99)
            await asyncio.gather(*(one(client, ids(warm, args.vocab, 64), 8)
                                   for _ in range(2 * workers)))
            rng = random.Random(args.seed)
            stop = asyncio.Event()
            read = asyncio.create_task(forecasts(url, fleet.prefix, workers, stop))
            started = time.monotonic()
            if args.workload in ("chat", "burst"):
                results = await (chat if args.workload == "chat" else burst)(client, args, rng)
            elif args.workload == "random":
                results = await random_prompts(client, args, rng)
            else:
                results = await priority(client, args, rng)
            wall = time.monotonic() - started
            stop.set()
        head = {"workers": workers, "route": route, "handed_over": fleet.routed()}
        if isinstance(results, dict):  # priority's parts
            return {**head, **{k: summary(v, wall, fleet.admissions()) if isinstance(v, list)
                               else v for k, v in results.items()}, "forecasts": await read}
        return {**head, **summary(results, wall, fleet.admissions()), "forecasts": await read}
    finally:
        fleet.stop()


def main() -> None:
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.logs or args.out, exist_ok=True)
    port = free_port()
    with EmbeddedRedis(port=port) as server:
        rows = []
        for spec in args.runs:
            workers, mode = spec.split(":")
            row = asyncio.run(run(args, server.url, int(workers), mode))
            rows.append(row)
            print(json.dumps(row), flush=True)
    tag = os.path.basename(args.model)
    with open(os.path.join(args.out, f"fleet-{args.workload}-{tag}.json"), "w") as f:
        json.dump({"args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
