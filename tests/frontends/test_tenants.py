"""A tenant is a prefix, isolated by a Redis ACL user limited to its keys (docs/operations.md,
"Tenants"): two routing workers, a client submitting with priorities, the gateway and
`roseinfer status` all run as that user, on a plain Redis and on a Redis Cluster, and no
other tenant's key is touched. Also: entries left under the backlog's old name are
carried over by a worker allowed to read it."""
import argparse

import openai
import pytest
import redis

from roseinfer import SamplingParams
from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys, hash_tag, prefix_arg
from roseinfer.frontends.redis_streams.server import free_port

from .conftest import FakeEngine, status_until, wait_until
from .test_cluster import start_cluster
from .test_reliability_processes import START_TIMEOUT_S, alive

# The line docs/operations.md gives; CLUSTER SLOTS is an admin command on Redis 6, so a
# cluster client there needs it named (Redis 7 allows it with -@dangerous).
ACL = ("on", ">secret", "~{prefix}:*", "&*", "+@all", "-@dangerous", "+cluster|slots")


def streamed(client, rid, timeout=60):
    """(token ids, finish reason) of a request, read from its reply stream."""
    chunks = list(client.stream(rid, timeout=timeout))
    return sum((c.token_ids for c in chunks), []), chunks[-1].finish_reason


def tenant_url(url: str, user: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:secret@{rest}"


@pytest.fixture
def plain(redis_server):
    yield [redis.Redis.from_url(redis_server.url)], redis_server.url


@pytest.fixture
def cluster_nodes():
    nodes = start_cluster()
    try:
        yield ([redis.Redis(port=n.port) for n in nodes],
               "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:2]))
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture(params=["plain", "cluster"])
def server(request):
    """(an admin client per node, the URL without credentials)."""
    return request.getfixturevalue("plain" if request.param == "plain" else "cluster_nodes")


def other_tenants_keys(admin, other: str) -> dict:
    """Another tenant's keys, one of each kind a fleet makes, as they stand now."""
    keys = Keys(other)
    for key in (keys.requests, keys.backlog, keys.cancel):
        admin.xadd(key, {"v": 1, "prompt": "theirs"})
    admin.set(keys.worker("theirs"), "{}")
    admin.sadd(keys.fleet, "theirs")
    return {k: admin.dump(k) for k in (keys.requests, keys.backlog, keys.cancel,
                                       keys.worker("theirs"), keys.fleet)}


def test_a_tenant_limited_to_its_prefix_runs_its_whole_fleet(
        server, worker_process, tiny_llm, prefix):
    admins, url = server
    user = f"u-{prefix}"
    for node in admins:
        node.execute_command("ACL", "SETUSER", user, *(a.format(prefix=prefix) for a in ACL))
        node.execute_command("ACL", "LOG", "RESET")
    admin = redis.RedisCluster(host="127.0.0.1", port=admins[0].connection_pool.connection_kwargs[
        "port"]) if len(admins) > 1 else admins[0]
    theirs = other_tenants_keys(admin, f"other-{prefix}")
    url = tenant_url(url, user)
    for name in ("a", "b"):  # routing is on by default
        worker_process(url, name)
    wait_until(lambda: alive(admin, prefix, "a", "b"), START_TIMEOUT_S)

    prompts = ["Interactive work", "Background work"]
    want = tiny_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    client = Client(url, prefix)
    rids = [client.submit(p, max_tokens=6, temperature=0, ignore_eos=True, priority=priority)
            for p, priority in zip(prompts, (0, 3))]
    assert [streamed(client, rid)[0] for rid in rids] == [w.token_ids for w in want]

    gateway = BackgroundGateway(GatewayConfig(url, prefix, model_name="tiny"), port=free_port())
    try:
        api = openai.OpenAI(base_url=f"{gateway.start().url}/v1", api_key="none", max_retries=0)
        done = api.completions.create(model="tiny", prompt=prompts[0], max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].text == want[0].text
    finally:
        gateway.stop()

    status = status_until(url, prefix, lambda out: "workers: 2 alive" in out)
    assert status.returncode == 0, status.stderr
    assert "workers: 2 alive" in status.stdout

    assert {k: admin.dump(k) for k in theirs} == theirs
    denied = {e[b"object"].decode() for node in admins
              for e in node.execute_command("ACL", "LOG") if e[b"reason"] != b"command"}
    # The one key a worker asks for outside the prefix, to learn whether it may carry
    # the old backlog over (test below); denied, it is left alone.
    assert denied <= {f"{{{prefix}:requests}}:backlog"}, denied


def test_every_key_starts_with_the_prefix_in_the_request_streams_slot():
    for prefix in ("roseinfer", "acme", "{acme}", "a{b}c"):
        keys = Keys(prefix)
        for key in (keys.backlog, keys.fleet, keys.inbox("c"), keys.cached("c"),
                    keys.roots("c"), keys.load("c")):
            assert key.startswith(prefix + ":")
            assert hash_tag(key) == hash_tag(keys.requests), key
    with pytest.raises(ValueError, match="braces"):
        Keys("a{b")
    with pytest.raises(argparse.ArgumentTypeError, match="braces"):  # --prefix, at once
        prefix_arg("a}b")


def test_entries_under_the_backlogs_old_name_are_carried_over(start_worker, real_redis, prefix):
    """A client built for the old name adds to it, before and after the worker starts:
    each request is served, its rid the entry ID that client was given."""
    old = f"{{{prefix}:requests}}:backlog"
    before = real_redis.xadd(old, {"v": 1, "prompt": "early", "max_tokens": 3,
                                   "priority": 2}).decode()
    start_worker(FakeEngine())
    wait_until(lambda: real_redis.xlen(old) == 0)
    after = real_redis.xadd(old, {"v": 1, "prompt": "late", "max_tokens": 3}).decode()
    client = Client(prefix=prefix, redis_client=real_redis)
    for rid in (before, after):
        assert streamed(client, rid, timeout=10)[1] == "length"
    assert real_redis.xlen(old) == real_redis.xlen(Keys(prefix).backlog) == 0
