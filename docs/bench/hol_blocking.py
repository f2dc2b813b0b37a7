"""Inter-token latency of decoding requests while maximum-size prompts keep arriving.

16 requests decode through a real Redis and worker (in-process thread) while, every
--every-s seconds, a prompt as long as the model's context allows arrives (text,
tokenized on the worker's reader thread, then prefilled by the engine). ITL is taken
per chunk on the client side; the run without the disturbance is the baseline.

    python docs/bench/hol_blocking.py --model gpt2-random --max-num-batched-tokens 4096
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

import numpy as np
import redis

from roseinfer import LLM
from roseinfer.frontends.redis_streams.client import AsyncClient, Client
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
from roseinfer.frontends.redis_streams.worker import Worker


def itl_ms(url: str, prefix: str, rids: list[str]) -> np.ndarray:
    """Gaps between a request's chunks as they arrive, all requests read at once."""
    async def gaps_of(client, rid):
        gaps, last = [], None
        async for _ in client.stream(rid, timeout=600):
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
        return gaps

    async def read_all():
        async with AsyncClient(url, prefix) as client:
            return await asyncio.gather(*(gaps_of(client, rid) for rid in rids))

    return np.asarray([g for gaps in asyncio.run(read_all()) for g in gaps]) * 1e3


def run(llm: LLM, url: str, prefix: str, disturb: bool, args, waits: list) -> np.ndarray:
    """The decoders' inter-token gaps; each maximum-size prompt's submit-to-answer
    time (one token) is appended to ``waits``."""
    worker = Worker(llm.engine, redis.Redis.from_url(url), prefix=prefix, block_ms=50,
                    chat_template=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = Client(url, prefix)
    rids = [client.submit(f"request {i}", max_tokens=args.tokens, temperature=0,
                          ignore_eos=True) for i in range(16)]
    stop = threading.Event()
    longest = "hello " * (llm.engine.max_model_len - 2)

    def answered(rid, sent):
        for _ in Client(url, prefix).stream(rid, timeout=600):
            pass
        waits.append(time.monotonic() - sent)

    def disturbance():
        while not stop.wait(args.every_s):
            sent = time.monotonic()
            rid = client.submit(longest, max_tokens=1)
            threading.Thread(target=answered, args=(rid, sent), daemon=True).start()

    if disturb:
        threading.Thread(target=disturbance, daemon=True).start()
    gaps = itl_ms(url, prefix, rids)
    stop.set()
    worker.stop(5)
    thread.join(30)
    return gaps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-random")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-mixed-prefill-tokens", type=int, default=None,
                   help="default: the engine's (16 on the CPU)")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--every-s", type=float, default=0.5)
    args = p.parse_args()
    llm = LLM(args.model, device="cpu", max_num_seqs=32, num_kv_blocks=2048,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_mixed_prefill_tokens=args.max_mixed_prefill_tokens)
    with EmbeddedRedis(port=free_port()) as server:
        waits = []
        base = run(llm, server.url, "hol-base", False, args, waits)
        hit = run(llm, server.url, "hol-hit", True, args, waits)
        time.sleep(args.every_s)  # the last prompts' answers
    for name, g in (("undisturbed", base), ("with max-size prompts", hit)):
        print(f"{name}: ITL p50 {np.percentile(g, 50):.1f} ms, p99 {np.percentile(g, 99):.1f} ms")
    print(f"p99 ratio: {np.percentile(hit, 99) / np.percentile(base, 99):.2f}x")
    print(f"max-size prompts answered: {len(waits)}, submit to answer "
          f"{', '.join(f'{w:.1f}' for w in sorted(waits))} s")


if __name__ == "__main__":
    main()
