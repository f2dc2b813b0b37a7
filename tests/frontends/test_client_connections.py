"""Clients release the connections they open, counted by the server (CLIENT LIST)."""
import asyncio
import threading

import redis

from roseinfer.frontends.redis_streams.client import AsyncClient, Client

from .conftest import wait_until


def connections(server) -> int:
    with redis.Redis.from_url(server.url) as probe:
        return len(probe.client_list()) - 1  # less the probe's own


def busy(client, prefix, k=8):
    """k threads submitting at once: the pool opens several connections."""
    threads = [threading.Thread(target=lambda: [client.submit("hi", rid=f"{prefix}-{i}-{j}")
                                                for j in range(20)]) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_closed_clients_leave_no_connection(redis_server, prefix):
    before = connections(redis_server)
    with Client(redis_server.url, prefix) as client:
        busy(client, prefix)
        assert connections(redis_server) > before + 1
    wait_until(lambda: connections(redis_server) == before, timeout=5)

    async def run():
        async with AsyncClient(redis_server.url, prefix) as client:
            await asyncio.gather(*[client.submit("hi") for _ in range(32)])
            assert connections(redis_server) > before + 1

    asyncio.run(run())
    wait_until(lambda: connections(redis_server) == before, timeout=5)


def test_a_client_passed_in_stays_open(redis_server, prefix):
    mine = redis.Redis.from_url(redis_server.url)
    mine.ping()
    with Client(redis_server.url, prefix, redis_client=mine) as client:
        client.submit("hi")
    assert mine.ping() and connections(redis_server) >= 1
    mine.close()
