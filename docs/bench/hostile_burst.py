"""Hostile entries among valid requests, through one worker that is full: how long each
refusal takes from its XADD to its final chunk (docs/operations.md, "Backpressure").

One `roseinfer worker` on the default model with --max-num-seqs 8 and an embedded Redis;
12 valid requests of 64 tokens, each followed by a hostile entry, two of each kind: a
54 MB body, a 50 MB shell-form prompt, a million prompt ids, 100,000 stop strings, a
million stop ids and a NaN temperature.

    python3 docs/bench/hostile_burst.py
"""
import subprocess
import sys
import time

import msgpack
import redis

from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port

MIB = 1 << 20
PREFIX = "hostile"


def body(**b) -> dict:
    return {"v": "1", "body": msgpack.packb(b)}


KINDS = [
    ("54 MB body", body(prompt="hello " * (9 * MIB))),
    ("50 MB shell prompt", {"prompt": "x" * (50 * MIB)}),
    ("a million ids", body(prompt_token_ids=[7] * 1_000_000)),
    ("100,000 stop strings", body(prompt="hi", stop=["a"] * 100_000)),
    ("a million stop ids", body(prompt="hi", stop_token_ids=[1] * 1_000_000)),
    ("NaN temperature", body(prompt="hi", temperature=float("nan"))),
]


def main() -> None:
    server = EmbeddedRedis(port=free_port()).start()
    worker = subprocess.Popen([sys.executable, "-m", "roseinfer.cli", "worker", "--redis-url",
                               server.url, "--prefix", PREFIX, "--max-num-seqs", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Client(server.url, PREFIX)
        client.generate("warm up", max_tokens=2, timeout=300)
        r = redis.Redis.from_url(server.url)
        valid, sent = [], []
        for i in range(12):
            valid.append(client.submit(f"Tell me about topic {i}", max_tokens=64, temperature=0))
            name, fields = KINDS[i % len(KINDS)]
            entry_id = r.xadd(Keys(PREFIX).requests, fields).decode()
            sent.append((name, entry_id, time.monotonic()))
        for name, entry_id, at in sent:
            (chunk,) = list(client.stream(entry_id, timeout=60))
            print(f"{name:22s} refused ({chunk.error['code']}) after {time.monotonic() - at:5.2f} s",
                  flush=True)
        for rid in valid:
            list(client.stream(rid, timeout=300))
    finally:
        worker.terminate()
        worker.wait()
        server.stop()


if __name__ == "__main__":
    main()
