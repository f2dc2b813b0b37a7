"""Background responses beside interactive chat: does work queued with `background: true`
(the backlog, priority 5) slow the chat requests that arrive meanwhile?

One `roseinfer worker` on the default model and one gateway, an embedded Redis. First
the interactive load alone: ``--chats`` streamed chat requests, one every ``--gap``
seconds, each timed to its first content token (TTFT). Then ``--background`` responses
created with `background: true` at once, and the same interactive load beside them;
then every background response is read until completed. Prints both TTFT p50 and p99,
their ratio, and how long the background work took.

    python3 docs/bench/background_responses.py [--chats 20] [--background 100]
"""
import argparse
import collections
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port

PREFIX = "background-bench"


def ttft(api, i: int, max_tokens: int) -> float:
    start = time.monotonic()
    for part in api.chat.completions.create(
            model="roseinfer", stream=True, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": f"Say something about the number {i}."}]):
        if part.choices and part.choices[0].delta.content:
            first = time.monotonic() - start
            break
    else:
        first = time.monotonic() - start
    return first


def chats(api, n: int, gap: float, max_tokens: int) -> list[float]:
    """``n`` chats, one every ``gap`` s, each in a thread: their TTFTs."""
    with ThreadPoolExecutor(n) as pool:
        futures = []
        for i in range(n):
            futures.append(pool.submit(ttft, api, i, max_tokens))
            time.sleep(gap)
        return [f.result() for f in futures]


def summary(label: str, times: list[float]) -> tuple[float, float]:
    p50, p99 = statistics.median(times), sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
    print(f"{label:28s} TTFT p50 {p50 * 1e3:7.1f} ms  p99 {p99 * 1e3:7.1f} ms", flush=True)
    return p50, p99


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--background", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    args = ap.parse_args()
    server = EmbeddedRedis(port=free_port()).start()
    worker = subprocess.Popen([sys.executable, "-m", "roseinfer.cli", "worker", "--redis-url",
                               server.url, "--prefix", PREFIX, "--max-num-seqs",
                               str(args.max_num_seqs)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = BackgroundGateway(GatewayConfig(server.url, PREFIX), port=free_port()).start()
    try:
        Client(server.url, PREFIX).generate("warm up", max_tokens=2, timeout=300)
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0,
                            timeout=600)
        alone = summary("chat alone", chats(api, args.chats, args.gap, args.max_tokens))
        start = time.monotonic()
        queued = [api.responses.create(model="roseinfer", background=True,
                                       max_output_tokens=args.max_tokens,
                                       input=f"Write about the color number {i}.").id
                  for i in range(args.background)]
        beside = summary(f"chat beside {args.background} background",
                         chats(api, args.chats, args.gap, args.max_tokens))
        statuses = {}
        while len(statuses) < len(queued):
            for rid in queued:
                if rid not in statuses:
                    status = api.responses.retrieve(rid).status
                    if status not in ("queued", "in_progress"):
                        statuses[rid] = status
            time.sleep(0.5)
        done = sum(s in ("completed", "incomplete") for s in statuses.values())
        print(f"background: {done} of {len(queued)} completed in "
              f"{time.monotonic() - start:.1f} s ({dict(collections.Counter(statuses.values()))})")
        print(f"TTFT beside / alone: p50 {beside[0] / alone[0]:.2f}x, p99 {beside[1] / alone[1]:.2f}x")
    finally:
        gateway.stop()
        worker.terminate()
        worker.wait()
        server.stop()


if __name__ == "__main__":
    main()
