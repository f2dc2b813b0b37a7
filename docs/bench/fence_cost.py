"""What the reply script's ownership fence and seq check cost Redis: one EVAL of 256
chunks (one per request of a 256-row step) with neither, with the fence (an XPENDING
per entry), and with the seq check as well (an XREVRANGE per chunk, after an outage
only). Median of 200 calls, an embedded redis-server. Usage: python3 docs/bench/fence_cost.py"""
import statistics
import time

import redis

from roseinfer.frontends.redis_streams.outbox import PUBLISH_SCRIPT
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port

CHUNKS = 256


def main() -> None:
    with EmbeddedRedis(port=free_port()) as server:
        r = redis.Redis.from_url(server.url)
        r.xgroup_create("q", "g", id="0", mkstream=True)
        ids = [r.xadd("q", {"a": 1}).decode() for _ in range(CHUNKS)]
        r.xreadgroup("g", "c1", {"q": ">"})
        keys = [f"out:{{{i}}}" for i in ids]

        def call(fence: bool, resent: bool, seq: int) -> float:
            chunks = [arg for i in ids for arg in (b"x" * 60, i, seq)]
            script_keys = keys + (["q"] if fence else [])
            start = time.perf_counter()
            r.execute_command("EVAL", PUBLISH_SCRIPT, len(script_keys), *script_keys, 3600,
                              100_000, "g" if fence else "", "c1", int(resent), *chunks)
            return time.perf_counter() - start

        for label, fence, resent in (("no fence", False, False), ("fence", True, False),
                                     ("fence + seq check", True, True)):
            ms = 1e3 * statistics.median(call(fence, resent, s) for s in range(200))
            print(f"{label:18s} {ms:.3f} ms per {CHUNKS}-chunk call")


if __name__ == "__main__":
    main()
