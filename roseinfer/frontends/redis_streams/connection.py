"""Redis clients from one URL form, for every command, client and worker.

- ``redis://[user:pass@]host:port[/db]`` (or ``rediss://``, ``unix://``): one server.
- ``redis+sentinel://[user:pass@]host:port[,host:port...]/PRIMARY[?db=N]``: the primary
  that the Sentinels name PRIMARY, found through the first Sentinel that answers and
  found again after a failover (redis-py's Sentinel pool asks them on reconnect). The
  credentials are the data servers'; Sentinels are asked without any. A primary that
  every Sentinel marks down is still the one they name (``NamingSentinel``).
- ``redis+cluster://[user:pass@]host:port[,host:port...]``: a Redis Cluster, found
  through the first of these nodes that answers; redis-py follows its slots as they
  move (a replica promoted after its primary died, say).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
SENTINEL_TIMEOUT_S = 2.0  # per Sentinel asked: a dead one must not hold the start for long


@dataclass(frozen=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    primary: str
    db: int = 0
    username: Optional[str] = None
    password: Optional[str] = None


def parse_sentinel(url: str) -> Optional[SentinelURL]:
    """The parts of a ``redis+sentinel://`` URL; None for any other scheme."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    sentinels, user = _hosts_and_user(parts, 26379)
    primary = unquote(parts.path.strip("/"))
    try:
        db = int(parse_qs(parts.query).get("db", ["0"])[0])
    except ValueError:
        db = -1
    if not sentinels or not primary or "/" in primary or db < 0:
        raise ValueError(f"{url!r} is not redis+sentinel://[user:pass@]host:port[,host:port...]"
                         "/PRIMARY[?db=N]")
    return SentinelURL(sentinels, primary, db, *user)


@dataclass(frozen=True)
class ClusterURL:
    nodes: list[tuple[str, int]]
    username: Optional[str] = None
    password: Optional[str] = None


def parse_cluster(url: str) -> Optional[ClusterURL]:
    """The parts of a ``redis+cluster://`` URL; None for any other scheme."""
    parts = urlsplit(url)
    if parts.scheme != CLUSTER_SCHEME:
        return None
    nodes, user = _hosts_and_user(parts, 6379)
    if not nodes or parts.path.strip("/") or parts.query:
        raise ValueError(f"{url!r} is not redis+cluster://[user:pass@]host:port[,host:port...]")
    return ClusterURL(nodes, *user)


def _hosts_and_user(parts, default_port: int) -> tuple[list, tuple]:
    """([(host, port)], (user, password)) of a URL's netloc; no hosts if a port is not a
    number."""
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    try:
        found = [_host_port(h, default_port) for h in hosts.split(",")]
    except ValueError:
        found = []
    return found, (unquote(username) or None, unquote(password) or None)


def is_cluster(client) -> bool:
    """Whether ``client`` talks to a Redis Cluster (its keys spread over slots)."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def by_slot(slot_of, pairs) -> list[list[tuple]]:
    """``pairs`` of (key, value) grouped by the cluster slot ``slot_of(key)``, in order:
    one command's worth each, since a command's keys must share a slot."""
    groups: dict[int, list] = {}
    for key, value in pairs:
        groups.setdefault(slot_of(key), []).append((key, value))
    return list(groups.values())


def follow_slots(client) -> None:
    """On a cluster, re-read the slot map (a no-op elsewhere): after a failed try, so that
    the next one finds a promoted replica. redis-py re-reads it on some errors only, and
    not on those a pipeline keeps in its replies."""
    if isinstance(client, redis.cluster.RedisCluster):
        try:
            client.nodes_manager.initialize()
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            pass  # no node answers yet: the next try asks again


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, default_port
    return host.strip("[]"), int(port)


def connect(url: str, max_connections: Optional[int] = None, **options) -> redis.Redis:
    """A client for ``url``. ``max_connections`` caps a single server's pool, threads
    waiting for a free connection; redis-py's Sentinel pool cannot wait, so it is left
    uncapped. Raises ConnectionError, saying which Sentinels were asked, when none of
    them names the primary, and ValueError for a malformed Sentinel URL."""
    return _connect(url, max_connections, options, redis, redis.sentinel)


def connect_async(url: str, max_connections: Optional[int] = None,
                  **options) -> redis.asyncio.Redis:
    """``connect`` for asyncio clients."""
    return _connect(url, max_connections, options, redis.asyncio, redis.asyncio.sentinel)


def _connect(url: str, max_connections: Optional[int], options: dict, lib, sentinels):
    """``lib``: redis or redis.asyncio, ``sentinels`` its sentinel module."""
    cluster = parse_cluster(url)
    if cluster is not None:
        return _connect_cluster(cluster, url, max_connections, options, lib)
    found = parse_sentinel(url)
    if found is None:
        pool = lib.BlockingConnectionPool if max_connections else lib.ConnectionPool
        return lib.Redis(connection_pool=pool.from_url(url, **_limit(max_connections),
                                                       **options))
    kwargs = _sentinel_kwargs(options)
    _check_primary(NamingSentinel(found.sentinels, sentinel_kwargs=kwargs), found, url)
    naming = NamingSentinel if sentinels is redis.sentinel else AsyncNamingSentinel
    return naming(found.sentinels, sentinel_kwargs=kwargs).master_for(
        found.primary, db=found.db, username=found.username, password=found.password, **options)


def disconnect(client) -> None:
    """Close ``client`` and every connection of its pool: redis-py leaves open a pool that
    was passed to the client, as ``connect`` passes it."""
    client.close()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        pool.disconnect()


async def disconnect_async(client) -> None:
    """``disconnect`` for asyncio clients."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect()


class NamingSentinel(redis.sentinel.Sentinel):
    """redis-py's Sentinel client, except that when every Sentinel marks the primary down
    it takes the address they name for it (``SENTINEL GET-MASTER-ADDR-BY-NAME``), as
    ioredis and Jedis do, instead of failing. A Sentinel marks a just-promoted primary
    down until its first PING reply (more often with a `down-after-milliseconds` under
    2 s: redis/redis#8607), and redis-py would let no client in for that while. A primary
    really down refuses the connection, and a demoted one answers READONLY, which sends
    redis-py back to the Sentinels: both are retried as before."""

    def discover_master(self, service_name):
        try:
            return super().discover_master(service_name)
        except redis.sentinel.MasterNotFoundError:
            for sentinel in self.sentinels:
                try:
                    if named := sentinel.sentinel_get_master_addr_by_name(service_name):
                        return named
                except (redis.ConnectionError, redis.TimeoutError):
                    continue
            raise


class AsyncNamingSentinel(redis.asyncio.sentinel.Sentinel):
    """``NamingSentinel`` for asyncio clients."""

    async def discover_master(self, service_name):
        try:
            return await super().discover_master(service_name)
        except redis.asyncio.sentinel.MasterNotFoundError:
            for sentinel in self.sentinels:
                try:
                    if named := await sentinel.sentinel_get_master_addr_by_name(service_name):
                        return named
                except (redis.ConnectionError, redis.TimeoutError):
                    continue
            raise


def _connect_cluster(found: ClusterURL, url: str, max_connections: Optional[int],
                     options: dict, lib):
    """A cluster client; the blocking one reads the slot map now, so a cluster that no
    node of the URL answers for fails here, saying which were asked."""
    nodes = [lib.cluster.ClusterNode(h, p) for h, p in found.nodes]
    limit = {"max_connections": max_connections} if max_connections else {}
    try:
        return lib.cluster.RedisCluster(startup_nodes=nodes, username=found.username,
                                        password=found.password, **limit, **options)
    except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
        asked = ", ".join(f"{h}:{p}" for h, p in found.nodes)
        raise redis.ConnectionError(f"no Redis Cluster node of {asked} answered (from {url}): "
                                    "check that they run with cluster-enabled yes and that "
                                    "the user may run CLUSTER SLOTS (an ACL on Redis 6 needs "
                                    f"+cluster|slots) ({e})") from None


def _limit(max_connections: Optional[int]) -> dict:
    """A blocking pool's cap; its threads wait as long as it takes for a connection."""
    return {"max_connections": max_connections, "timeout": None} if max_connections else {}


def _sentinel_kwargs(options: dict) -> dict:
    timeout = min(options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S, SENTINEL_TIMEOUT_S)
    return {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": timeout}


def _check_primary(sentinel: redis.sentinel.Sentinel, found: SentinelURL, url: str) -> None:
    """Fail at start, not at the first command, when no Sentinel names the primary."""
    try:
        sentinel.discover_master(found.primary)
    except redis.sentinel.MasterNotFoundError:
        asked = ", ".join(f"{h}:{p}" for h, p in found.sentinels)
        raise redis.ConnectionError(
            f"no Sentinel of {asked} answered with a primary named {found.primary!r} "
            f"(from {url}): check that they run, and the name after the last '/'") from None
