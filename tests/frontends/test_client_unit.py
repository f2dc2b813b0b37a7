"""The Python clients on fakeredis: ordering, duplicates, errors, timeouts, asyncio."""
import asyncio

import fakeredis
import msgpack
import pytest

from roseinfer.frontends.redis_streams.client import AsyncClient, Client, RequestFailed
from roseinfer.frontends.redis_streams.protocol import Chunk, Keys, encode_chunk
from roseinfer.frontends.redis_streams.worker import Worker

KEYS = Keys("c")
USAGE = {"prompt_tokens": 1, "completion_tokens": 3}


def put(redis, *chunks):
    for c in chunks:
        redis.xadd(KEYS.out(c.rid), encode_chunk(c))


@pytest.fixture
def client(fake_redis):
    return Client(prefix="c", redis_client=fake_redis)


def test_submit_writes_a_v1_entry(client, fake_redis):
    rid = client.submit("Hello", max_tokens=3, temperature=0)
    ((entry_id, fields),) = fake_redis.xrange(KEYS.requests)
    assert rid == entry_id.decode() and fields[b"v"] == b"1" and b"rid" not in fields
    assert msgpack.unpackb(fields[b"body"]) == {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert client.submit([1, 2], rid="mine") == "mine"


def test_stream_yields_in_seq_order_and_skips_duplicates(client, fake_redis):
    put(fake_redis, Chunk("r", 0, [1], "a"), Chunk("r", 1, [2], "b"), Chunk("r", 1, [2], "b"),
        Chunk("r", 0, [1], "a"), Chunk("r", 2, [3], "c", "length", USAGE),
        Chunk("r", 3, [9], "z"))  # nothing after the final chunk belongs to the request
    got = list(client.stream("r", timeout=1))
    assert [(c.seq, c.text) for c in got] == [(0, "a"), (1, "b"), (2, "c")]


def test_generate_assembles_the_result(client, fake_redis):
    put(fake_redis, Chunk("g", 0, [1], "a"), Chunk("g", 1, [2, 3], "bc", "stop", USAGE))
    result = client.generate("x", rid="g", timeout=1)
    assert (result.rid, result.text, result.token_ids, result.finish_reason, result.usage) == \
        ("g", "abc", [1, 2, 3], "stop", USAGE)


def test_generate_raises_the_workers_error(client, fake_redis):
    put(fake_redis, Chunk("e", 0, [], "", "error", USAGE, {"code": "too_long", "message": "prompt: long"}))
    with pytest.raises(RequestFailed) as e:
        client.generate("x", rid="e", timeout=1)
    assert (e.value.rid, e.value.code, e.value.message) == ("e", "too_long", "prompt: long")


def test_a_stream_added_while_redis_fails_over_is_still_read(client, fake_redis):
    """Adding a stream rings the reader's bell; when Redis refuses the ring (a failover)
    the stream is read anyway, by the reader's next read."""
    import threading
    import time

    from redis.exceptions import ConnectionError

    first = client.stream("a", timeout=5)
    put(fake_redis, Chunk("a", 0, [1], "x"))
    assert next(first).text == "x"  # the reader runs, blocked on "a" now
    time.sleep(0.05)
    real = fake_redis.pipeline

    def refusing(*args, **kwargs):
        pipe = real(*args, **kwargs)

        def execute(*a, **k):
            raise ConnectionError("primary gone")
        pipe.execute = execute
        return pipe

    client.redis.pipeline = refusing
    threading.Timer(0.2, put, (fake_redis, Chunk("b", 0, [2], "y", "length", USAGE))).start()
    got = list(client.stream("b", timeout=5))
    assert [c.text for c in got] == ["y"]
    client.redis.pipeline = real


def failing_twice(xadd):
    """``xadd`` that raises a failover's ConnectionError on its first two calls."""
    from redis.exceptions import ConnectionError

    failures = [ConnectionError("primary gone")] * 2

    def call(*args, **kwargs):
        if failures:
            raise failures.pop()
        return xadd(*args, **kwargs)
    return call


def test_submit_and_cancel_ride_out_a_failover_window(client, fake_redis, monkeypatch):
    from redis.exceptions import ResponseError

    monkeypatch.setattr(client.redis, "xadd", failing_twice(fake_redis.xadd))
    rid = client.submit("Hello", max_tokens=3)
    ((entry_id, _),) = fake_redis.xrange(KEYS.requests)
    assert rid == entry_id.decode()
    monkeypatch.setattr(client.redis, "xadd", failing_twice(fake_redis.xadd))
    client.cancel(rid)
    assert fake_redis.xlen(KEYS.cancel) == 1

    def refused(*args, **kwargs):
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    monkeypatch.setattr(client.redis, "xadd", refused)
    with pytest.raises(ResponseError):  # not transient: at once
        client.submit("Hello")


def test_async_submit_rides_out_a_failover_window(monkeypatch):
    async def main():
        redis_client = fakeredis.FakeAsyncRedis()
        client = AsyncClient(prefix="c", redis_client=redis_client)
        real = redis_client.xadd
        calls = failing_twice(lambda *a, **k: real(*a, **k))
        monkeypatch.setattr(redis_client, "xadd", calls)
        rid = await client.submit("Hello", max_tokens=3)
        assert [e.decode() for e, _ in await redis_client.xrange(KEYS.requests)] == [rid]
    asyncio.run(main())


def test_stream_times_out_with_a_hint(client):
    with pytest.raises(TimeoutError, match="is a worker running with prefix 'c'"):
        list(client.stream("nobody", timeout=0.05))


def test_cancel_writes_the_rid(client, fake_redis):
    client.cancel("r9")
    ((_, fields),) = fake_redis.xrange(KEYS.cancel)
    assert fields == {b"rid": b"r9"}


def test_async_client_against_a_worker(fake_engine):
    server = fakeredis.FakeServer()
    worker = Worker(fake_engine, fakeredis.FakeRedis(server=server), prefix="c", block_ms=1,
                    send_thread=False)
    worker.setup()

    async def main():
        async with AsyncClient(prefix="c", redis_client=fakeredis.FakeAsyncRedis(server=server)) as client:
            rid = await client.submit("a", max_tokens=3)
            doomed = await client.submit("a", max_tokens=30)
            await client.cancel(doomed)
            for _ in range(6):
                worker.run_once()
            chunks = [c async for c in client.stream(rid, timeout=1)]
            put(worker.redis, Chunk("x", 0, [7], "q", "stop", USAGE))
            return chunks, await client.generate("x", rid="x", timeout=1), \
                [c async for c in client.stream(doomed, timeout=1)]

    chunks, result, aborted = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [[98], [99], [0]] and chunks[-1].finish_reason == "length"
    assert (result.text, result.finish_reason) == ("q", "stop")
    assert aborted[-1].finish_reason == "abort"
