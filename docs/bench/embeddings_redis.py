"""Embeddings through Redis against the engine alone: the same texts and model as
embeddings.py, embedded by ``LLM.embed`` in this process, then by CLIENTS client
processes through a real Redis (the embedded redis-server ``roseinfer serve`` starts) to
one worker on the same engine, each process sending its share as requests of
``--request-texts`` texts, ``--in-flight`` at a time. Texts a second, best of
``--rounds`` each, and the largest difference from the engine's vectors (a text
batched with others may round differently, most in bfloat16).

    python3 docs/bench/embeddings_redis.py [--device cpu] [--shape minilm] [--texts 1024]
        [--clients 4] [--request-texts 64] [--in-flight 2] [--rounds 3]
"""
import argparse
import multiprocessing
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from embeddings import SHAPES, build, texts  # noqa: E402
from roseinfer import LLM  # noqa: E402
from roseinfer.frontends.redis_streams.client import Client  # noqa: E402
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port  # noqa: E402
from roseinfer.frontends.redis_streams.worker import Worker  # noqa: E402


def client_share(url: str, prefix: str, share: list[str], per_request: int,
                 in_flight: int) -> list:
    """One client process: its share in requests, ``in_flight`` at a time; the vectors."""
    client = Client(url, prefix=prefix)
    chunks = [share[i:i + per_request] for i in range(0, len(share), per_request)]
    with ThreadPoolExecutor(in_flight) as pool:
        done = list(pool.map(lambda c: client.embed(c).embeddings,
                             chunks))
    client.close()
    return [v for chunk in done for v in chunk]


def ready(barrier) -> None:
    """A client process's start: once its imports are done, it waits for the others."""
    barrier.wait()


def through_redis(url: str, prefix: str, corpus: list[str], args) -> tuple[float, list]:
    shares = [corpus[i::args.clients] for i in range(args.clients)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(args.clients + 1)
    with ctx.Pool(args.clients, initializer=ready, initargs=(barrier,)) as pool:
        # Every process started and imported before the clock: spawning four that import
        # torch takes seconds on two cores, which the first requests' arrival once counted
        barrier.wait()
        start = time.perf_counter()
        results = pool.starmap(client_share, [(url, prefix, s, args.request_texts,
                                               args.in_flight) for s in shares])
        elapsed = time.perf_counter() - start
    vectors = [None] * len(corpus)
    for i, result in enumerate(results):
        vectors[i::args.clients] = result
    return len(corpus) / elapsed, vectors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=SHAPES, default="minilm")
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--request-texts", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    folder = build(Path(tempfile.mkdtemp()), SHAPES[args.shape])
    corpus = texts(args.texts, args.min_tokens, args.max_tokens)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    llm = LLM(folder, device=args.device, dtype=dtype,
              max_num_batched_tokens=args.request_texts * (args.min_tokens + args.max_tokens) // 2)
    alone, want = [], None
    llm.embed(corpus[:args.request_texts])  # warm-up
    for _ in range(args.rounds):
        start = time.perf_counter()
        want = [o.embedding for o in llm.embed(corpus)]
        alone.append(len(corpus) / (time.perf_counter() - start))
    server = EmbeddedRedis(port=free_port()).start()
    worker = Worker(llm.engine, redis.Redis.from_url(server.url), prefix="bench", block_ms=100)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    rates, gap = [], 0.0
    try:
        for _ in range(args.rounds):
            rate, got = through_redis(server.url, "bench", corpus, args)
            rates.append(rate)
            gap = max(gap, max(float(np.abs(np.asarray(g) - np.asarray(w)).max())
                               for g, w in zip(got, want)))
    finally:
        worker.stop(5)
        thread.join(20)
        server.stop()
    print(f"{args.shape} on {args.device}, {len(corpus)} texts: engine alone "
          f"{max(alone):.1f} texts/s (rounds {', '.join(f'{r:.1f}' for r in alone)}); "
          f"through Redis, {args.clients} client processes: {max(rates):.1f} texts/s "
          f"(rounds {', '.join(f'{r:.1f}' for r in rates)}): {max(rates) / max(alone):.2f}x; "
          f"largest difference from the engine's vectors: {gap:.2e}")


if __name__ == "__main__":
    main()
