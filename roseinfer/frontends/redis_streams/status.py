"""`roseinfer status`: the live workers (heartbeats), the queue and what is in flight.

Read-only: a handful of reads against the deployment's Redis, safe to run any time.
"""
from __future__ import annotations

from redis import Redis

from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
from roseinfer.frontends.redis_streams.protocol import Keys, entry_time


def collect(redis: Redis, keys: Keys, group: str) -> dict:
    seconds, micros = redis.time()
    now = seconds + micros / 1e6  # Redis's clock, the one entry IDs come from
    workers = read_heartbeats(redis, keys)
    status = {"stream": keys.requests, "group": group, "waiting": 0, "oldest_waiting_s": None,
              "pending": 0, "dead": redis.xlen(keys.dead), "backlog": redis.xlen(keys.backlog),
              "workers": workers, "orphans": []}
    groups = redis.xinfo_groups(keys.requests) if redis.exists(keys.requests) else []
    info = next((g for g in groups if g["name"].decode() == group), None)
    if info is None:
        return status
    status["pending"] = info["pending"]
    status["waiting"] = _waiting(redis, keys, info)
    first = redis.xrange(keys.requests, min="(" + info["last-delivered-id"].decode(), count=1)
    if first:
        status["oldest_waiting_s"] = max(0.0, now - entry_time(first[0][0].decode()))
    live = {w["consumer"] for w in workers}
    pending_by = {c["name"].decode(): c for c in redis.xinfo_consumers(keys.requests, group)}
    for w in workers:
        w["pending"] = pending_by.get(w["consumer"], {}).get("pending", 0)
    status["orphans"] = [{"consumer": name, "pending": c["pending"], "idle_s": c["idle"] / 1000}
                         for name, c in sorted(pending_by.items())
                         if c["pending"] and name not in live]
    return status


def _waiting(redis: Redis, keys: Keys, info: dict) -> int:
    # Redis 7 reports the group's lag; before that (and when it cannot tell) the stream
    # length does: workers delete what they acknowledge, so the stream holds exactly the
    # pending entries and the waiting ones.
    if info.get("lag") is not None:
        return info["lag"]
    return max(0, redis.xlen(keys.requests) - info["pending"])


def render(s: dict) -> str:
    oldest = "" if s["oldest_waiting_s"] is None else f", oldest {s['oldest_waiting_s']:.1f}s"
    queue = (f"queue {s['stream']} (group {s['group']}): {s['waiting']} waiting{oldest}, "
             f"{s['pending']} pending, {s['dead']} dead-lettered, {s['backlog']} in the backlog "
             "(priority > 0)")
    lines = [queue, f"workers: {len(s['workers'])} alive"]
    if s["workers"]:
        lines.append(f"  {'CONSUMER':<28} {'STATUS':<9} {'IN-FLIGHT':>9} {'RUNNING':>7} "
                     f"{'WAITING':>7} {'KV-CACHE':>8} {'FINISHED':>8} {'SEEN':>6}  STEP")
    for w in s["workers"]:
        lines.append(f"  {w['consumer']:<28} {w['status']:<9} {w['in_flight']:>9} "
                     f"{w['running']:>7} {w['waiting']:>7} {w['kv_cache_usage']:>8.0%} "
                     f"{w['finished']:>8} {w['age_s']:>5.1f}s  {w.get('step', '?')}")
        if w.get("adapters") or w.get("adapter_errors"):
            errors = "".join(f"; {n} failed: {e}" for n, e in w.get("adapter_errors", {}).items())
            lines.append(f"    LoRA adapters: {', '.join(w.get('adapters', [])) or 'none'}{errors}")
    if s["orphans"]:
        lines.append("consumers holding entries without a heartbeat (dead workers; the entries "
                     "are claimed once idle past --claim-idle-ms):")
        lines += [f"  {o['consumer']}: {o['pending']} pending, idle {o['idle_s']:.1f}s"
                  for o in s["orphans"]]
    return "\n".join(lines)
