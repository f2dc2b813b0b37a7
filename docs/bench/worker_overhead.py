"""The Redis worker's own cost per step, with an engine that costs nothing.

A null engine hands back one output per running request per step, as the real engine
does (``--tokens-per-step 8`` mimics a decode window), so the worker's time is all
frontend: chunks, encoding, the Redis pipeline, reading entries and cancels. Requests
are queued up front and nobody reads the replies, so the clients cost nothing either.
``--step-ms`` makes each step wait that long without the GIL, as a GPU step does, after
``--host-ms`` of Python work holding it, as the engine's launch does; the
same requests are then also run on the null engine alone (as `bench serve
--compare-offline` does with the real one), and the ratio is what the worker keeps.

    python docs/bench/worker_overhead.py --requests 2048 --max-num-seqs 256 --max-tokens 256
    python docs/bench/worker_overhead.py --profile    # cProfile of the worker loop, top 25
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
import time
from dataclasses import dataclass

import redis

from roseinfer.core.config import EngineConfig
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
from roseinfer.frontends.redis_streams.worker import Worker


@dataclass(slots=True)
class _Out:
    request_id: str
    new_token_ids: list
    new_text: str
    finished: bool
    finish_reason: object
    prompt_token_ids: list
    token_ids: list
    new_logprobs: object = None
    prompt_logprobs: object = None
    index: int = 0
    error: object = None
    num_cached_tokens: int = 0


@dataclass
class _Stats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class NullEngine:
    """The engine contract at no cost: token t is followed by t+1, one letter of text each."""
    tokenizer = None
    vocab_size = 50_000
    step_kind = "eager"

    def __init__(self, max_num_seqs: int, tokens_per_step: int, step_s: float = 0.0,
                 host_s: float = 0.0):
        self.config = EngineConfig(device="cpu", max_num_seqs=max_num_seqs)
        self.per_step = tokens_per_step
        self.step_s, self.host_s = step_s, host_s
        self.seqs: dict[str, list] = {}
        self.steps = 0

    def add_request(self, rid, prompt, params, emitted_ids=None, emitted_text=None):
        self.seqs[rid] = [list(prompt), [], params.max_tokens, False]

    def step(self):
        self.steps += 1
        busy_until = time.perf_counter() + self.host_s
        while time.perf_counter() < busy_until:
            pass
        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for rid, s in list(self.seqs.items()):
            prompt, done, max_tokens, aborted = s
            n = 0 if aborted else min(self.per_step, max_tokens - len(done))
            new = list(range(len(done), len(done) + n))
            done += new
            reason = "abort" if aborted else "length" if len(done) >= max_tokens else None
            if reason:
                del self.seqs[rid]
            outs.append(_Out(rid, new, "x" * n, reason is not None, reason, prompt, done))
        return outs

    def abort(self, rid):
        if rid in self.seqs:
            self.seqs[rid][3] = True

    def has_unfinished(self):
        return bool(self.seqs)

    def num_unfinished(self):
        return len(self.seqs)

    def stats(self):
        return _Stats(len(self.seqs), 0, 0.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--host-ms", type=float, default=0.0)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    with EmbeddedRedis(port=free_port()) as server:
        engine = NullEngine(args.max_num_seqs, args.tokens_per_step, args.step_ms / 1e3,
                        args.host_ms / 1e3)
        r = redis.Redis.from_url(server.url)
        client = Client(redis_client=r, prefix="wo")
        pipe = r.pipeline(transaction=False)
        for i in range(args.requests):
            pipe.xadd(client.keys.requests, _entry(client, i, args.max_tokens))
        pipe.execute()
        worker = Worker(engine, redis.Redis.from_url(server.url), prefix="wo", block_ms=50)
        prof = cProfile.Profile() if args.profile else None
        done = threading.Event()
        t0 = time.perf_counter()
        _serve(worker, prof, lambda: worker._totals["finished"] >= args.requests)
        elapsed = time.perf_counter() - t0
        done.set()
        tokens = args.requests * args.max_tokens
        print(f"{tokens / elapsed:,.0f} tok/s; {engine.steps} steps, "
              f"{1e3 * elapsed / engine.steps:.3f} ms per step, "
              f"{1e6 * elapsed / (engine.steps * args.max_num_seqs):.2f} us per output")
        if args.step_ms:
            alone = _engine_alone(args)
            print(f"{tokens / elapsed / alone:.2f}x the engine alone ({alone:,.0f} tok/s)")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _engine_alone(args) -> float:
    """tok/s of the null engine stepping the same requests with no frontend, 256 at a time."""
    from roseinfer.core.sampling import SamplingParams

    engine = NullEngine(args.max_num_seqs, args.tokens_per_step, args.step_ms / 1e3,
                        args.host_ms / 1e3)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    queued = [f"r-{i}" for i in range(args.requests)]
    t0 = time.perf_counter()
    while queued or engine.has_unfinished():
        while queued and engine.num_unfinished() < args.max_num_seqs:
            engine.add_request(queued.pop(), list(range(32)), params)
        engine.step()
    return args.requests * args.max_tokens / (time.perf_counter() - t0)


def _entry(client: Client, i: int, max_tokens: int) -> dict:
    from roseinfer.frontends.redis_streams.protocol import encode_request
    return encode_request(list(range(32)), f"r-{i}", max_tokens=max_tokens, temperature=0.0,
                          ignore_eos=True)


def _serve(worker: Worker, prof, finished) -> None:
    worker.setup()
    if prof:
        prof.enable()
    while not finished():
        worker.run_once()
    if prof:
        prof.disable()
    worker.stop(0)
    worker.run()


if __name__ == "__main__":
    main()
