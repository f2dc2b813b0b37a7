"""The worker's sender thread and the clients' one-reader multiplexing, against a real
redis-server: chunks stay in order, a crash between a step and its send loses nothing,
and thousands of streams share a handful of connections."""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import AsyncClient, Client

from .conftest import FakeEngine, assert_well_formed, raw_chunks, wait_until
from .test_reliability import fake_tokens


class Crash(BaseException):
    """The worker process dying: nothing after it runs, nothing is handed back."""


def test_chunks_keep_their_order_while_redis_lags_behind_the_steps(start_worker, real_redis,
                                                                   prefix, redis_server):
    worker = start_worker(FakeEngine(max_num_seqs=8))
    send = worker.worker.outbox._send
    worker.worker.outbox._sender._send = lambda rnd: time.sleep(0.01) or send(rnd)
    # Cancels older than a worker's start are not its business: let it start first.
    wait_until(lambda: real_redis.keys(f"{prefix}:workers:*"))
    client = Client(redis_server.url, prefix)
    rids = [client.submit(f"p{i}", max_tokens=30, stream_interval=1 + i % 3) for i in range(8)]
    doomed = client.submit("x", max_tokens=50)
    client.cancel(doomed)
    for i, rid in enumerate(rids):
        chunks = raw_chunks_when_done(client, real_redis, prefix, rid)
        assert_well_formed(chunks)
        assert sum((c.token_ids for c in chunks), []) == fake_tokens(f"p{i}", 30)
    assert list(client.stream(doomed, timeout=10))[-1].finish_reason == "abort"


def raw_chunks_when_done(client, real_redis, prefix, rid):
    list(client.stream(rid, timeout=20))
    return raw_chunks(real_redis, prefix, rid)


def test_a_crash_between_a_step_and_its_send_loses_nothing(start_worker, real_redis, prefix,
                                                           redis_server):
    crashing = start_worker(FakeEngine(max_num_seqs=8, step_s=0.005), consumer="crashing",
                            claim_idle_ms=300)
    sends, send = [], crashing.worker.outbox._send

    def send_until_the_crash(round_trip):
        sends.append(round_trip)
        if len(sends) == 12:  # this step's chunks never reach Redis, nor does anything after
            raise Crash()
        return send(round_trip)

    crashing.worker.outbox._sender._send = send_until_the_crash
    client = Client(redis_server.url, prefix)
    rids = [client.submit(f"q{i}", max_tokens=40) for i in range(6)]
    wait_until(lambda: not crashing.alive())
    assert isinstance(crashing.error, Crash)
    assert 0 < len(raw_chunks(real_redis, prefix, rids[0])) < 40  # it died mid-request
    start_worker(FakeEngine(max_num_seqs=8), consumer="survivor", claim_idle_ms=300)
    for i, rid in enumerate(rids):
        chunks = list(client.stream(rid, timeout=20))
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum((c.token_ids for c in chunks), []) == fake_tokens(f"q{i}", 40)
    crashing.error = None  # the crash was the point


def client_connections(admin, name):
    return sum(c["name"] == name for c in admin.client_list())


def test_async_client_streams_2000_requests_over_at_most_8_connections(
        tiny_llm, start_worker, real_redis, redis_server, prefix):
    worker = start_worker(tiny_llm.engine)
    prompts = [[(7 * i) % 50257, (11 * i) % 50257] for i in range(2000)]
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], client_connections(real_redis, "mux-async"))
            time.sleep(0.05)

    async def run_all():
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            redis_server.url, max_connections=8, timeout=None, client_name="mux-async")
        async with AsyncClient(prefix=prefix, redis_client=redis.asyncio.Redis(
                connection_pool=pool)) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=3, temperature=0,
                                                          timeout=120) for p in prompts))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(run_all())
    finally:
        done.set()
        watcher.join()
    worker.stop()  # before LLM.generate: one engine, one caller at a time
    assert 1 <= peak[0] <= 8
    for r in results:
        assert_well_formed(raw_chunks(real_redis, prefix, r.rid))
    sample = range(0, 2000, 97)
    expected = tiny_llm.generate([prompts[i] for i in sample],
                                 SamplingParams(max_tokens=3, temperature=0))
    assert [results[i].token_ids for i in sample] == [e.token_ids for e in expected]


def test_sync_client_serves_64_threads_over_at_most_8_connections(start_worker, real_redis,
                                                                  redis_server, prefix):
    start_worker(FakeEngine(max_num_seqs=64))
    client = Client(redis_server.url, prefix)  # the default pool: at most 8 connections
    client.redis.connection_pool.connection_kwargs["client_name"] = "mux-sync"
    peak = [0]

    def one(i):
        result = client.generate(f"s{i}", max_tokens=10, timeout=30)
        peak[0] = max(peak[0], client_connections(real_redis, "mux-sync"))
        return result

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(640)))
    assert [r.token_ids for r in results] == [fake_tokens(f"s{i}", 10) for i in range(640)]
    assert 1 <= peak[0] <= 8
    client.close()
