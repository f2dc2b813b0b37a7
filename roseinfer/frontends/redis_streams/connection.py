"""Redis clients from one URL form, for every command, client and worker.

- ``redis://[user:pass@]host:port[/db]`` (or ``rediss://``, ``unix://``): one server.
- ``redis+sentinel://[user:pass@]host:port[,host:port...]/PRIMARY[?db=N]``: the primary
  that the Sentinels name PRIMARY, found through the first Sentinel that answers and
  found again after a failover (redis-py's Sentinel pool asks them on reconnect). The
  credentials are the data servers'; Sentinels are asked without any.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

SENTINEL_SCHEME = "redis+sentinel"
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
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    primary = unquote(parts.path.strip("/"))
    try:
        sentinels = [_host_port(h) for h in hosts.split(",")]
        db = int(parse_qs(parts.query).get("db", ["0"])[0])
    except ValueError:
        sentinels, db = [], -1
    if not sentinels or not primary or "/" in primary or db < 0:
        raise ValueError(f"{url!r} is not redis+sentinel://[user:pass@]host:port[,host:port...]"
                         "/PRIMARY[?db=N]")
    return SentinelURL(sentinels, primary, db, unquote(username) or None,
                       unquote(password) or None)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, 26379  # Sentinel's default port
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
    found = parse_sentinel(url)
    if found is None:
        pool = lib.BlockingConnectionPool if max_connections else lib.ConnectionPool
        return lib.Redis(connection_pool=pool.from_url(url, **_limit(max_connections),
                                                       **options))
    kwargs = _sentinel_kwargs(options)
    _check_primary(redis.sentinel.Sentinel(found.sentinels, sentinel_kwargs=kwargs), found, url)
    return sentinels.Sentinel(found.sentinels, sentinel_kwargs=kwargs).master_for(
        found.primary, db=found.db, username=found.username, password=found.password, **options)


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
