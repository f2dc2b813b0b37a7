"""Reliability against a real redis-server, with workers in threads on the fake engine:
ownership of long requests, poison entries, a Redis restart, metrics and status.
(Worker processes killed or stopped by signals: test_reliability_processes.py.)"""
import logging
import time
import urllib.request

import redis
from prometheus_client.parser import text_string_to_metric_families

from roseinfer.frontends.redis_streams import status
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.metrics import Metrics, serve
from roseinfer.frontends.redis_streams.protocol import Keys
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
from roseinfer.frontends.redis_streams.worker import QUEUED_PAST_SLOTS, Worker

from .conftest import (FakeEngine, WorkerThread, assert_well_formed, pending, raw_chunks,
                       wait_until)


def fake_tokens(prompt, n):
    """What the fake engine generates: after token t comes t+1 (mod 100)."""
    last = ord(prompt[-1]) % 100
    return [(last + i) % 100 for i in range(1, n + 1)]


def test_long_decode_is_not_taken_over_by_a_live_worker(start_worker, real_redis, prefix, redis_server):
    owner = FakeEngine(step_s=0.02)
    start_worker(owner, consumer="owner", claim_idle_ms=200)
    client = Client(redis_server.url, prefix)
    rid = client.submit("a", max_tokens=60)  # 60 steps of 20 ms: six times the claim threshold
    wait_until(lambda: raw_chunks(real_redis, prefix, rid))
    other = FakeEngine()
    start_worker(other, consumer="other", claim_idle_ms=200)  # claims every 50 ms
    assert list(client.stream(rid, timeout=10))[-1].finish_reason == "length"
    got = raw_chunks(real_redis, prefix, rid)
    assert_well_formed(got)  # one writer: no seq twice
    assert sum((c.token_ids for c in got), []) == fake_tokens("a", 60)
    assert rid not in other.added
    assert pending(real_redis, prefix) == 0


def test_poison_entry_goes_to_dead_and_the_rest_of_its_batch_finishes(start_worker, real_redis, prefix, redis_server):
    client = Client(redis_server.url, prefix)
    # Queued before the worker starts, so the poison shares its batch with every good one.
    good = [client.submit(f"ok{i}", max_tokens=6) for i in range(3)]
    bad = client.submit("poison!", max_tokens=6)
    worker = start_worker(FakeEngine(poison="poison!"), claim_idle_ms=200, max_deliveries=3)
    for i, rid in enumerate(good):
        assert list(client.stream(rid, timeout=20))[-1].finish_reason == "length"
        got = raw_chunks(real_redis, prefix, rid)
        assert_well_formed(got)
        assert sum((c.token_ids for c in got), []) == fake_tokens(f"ok{i}", 6)
    final = list(client.stream(bad, timeout=20))[-1]
    assert (final.finish_reason, final.error["code"]) == ("error", "dead_letter")
    assert f"{prefix}:dead" in final.error["message"]
    assert_well_formed(raw_chunks(real_redis, prefix, bad))  # its first token, then the error
    (dead_id, dead), = real_redis.xrange(Keys(prefix).dead)
    assert dead[b"dead_rid"].decode() == bad and dead[b"dead_deliveries"] == b"4"
    assert dead[b"body"]  # the request itself, to replay once fixed
    assert worker.alive()
    wait_until(lambda: pending(real_redis, prefix) == 0)
    assert client.generate("after", max_tokens=2, timeout=10).finish_reason == "length"


def test_worker_rides_out_a_redis_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="roseinfer.worker")
    server = EmbeddedRedis(port=free_port(), data_dir=str(tmp_path)).start()
    worker = None
    try:
        engine = FakeEngine(step_s=0.01)
        worker = WorkerThread(Worker(engine, redis.Redis.from_url(server.url, socket_timeout=5),
                                     prefix="r", block_ms=100))
        worker.thread.start()
        before = Client(server.url, "r")
        rids = [before.submit(f"req{i}", max_tokens=50) for i in range(4)]
        wait_until(lambda: len(raw_chunks(before.redis, "r", rids[0])) >= 3)
        before.close()
        server.stop(kill=True)  # a crash: only what the AOF holds survives
        time.sleep(1.0)
        server.start()
        client = Client(server.url, "r")
        for i, rid in enumerate(rids):
            chunks = list(client.stream(rid, timeout=20))
            assert [c.seq for c in chunks] == list(range(len(chunks)))
            assert chunks[-1].finish_reason == "length"
            assert sum((c.token_ids for c in chunks), []) == fake_tokens(f"req{i}", 50)
            # as written: the worker resent only what the restarted Redis lacked
            assert_well_formed(raw_chunks(client.redis, "r", rid))
        assert worker.alive()
        wait_until(lambda: pending(client.redis, "r") == 0)
        worker.stop()
    finally:
        if worker is not None and worker.alive():
            worker.worker.stop(0)
            worker.thread.join(10)
        server.stop()
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events.count("event=redis_unavailable") == 1 and events.count("event=redis_back") == 1


def test_worker_holds_its_chunks_while_redis_is_full(start_worker, real_redis, prefix,
                                                    redis_server, caplog):
    """Redis at maxmemory (noeviction) refuses the chunks: the worker waits, as for an
    outage, and sends them once there is room; none is lost."""
    caplog.set_level(logging.INFO, logger="roseinfer.worker")
    worker = start_worker(FakeEngine(step_s=0.01))
    client = Client(redis_server.url, prefix)
    rid = client.submit("full", max_tokens=50)
    wait_until(lambda: len(raw_chunks(real_redis, prefix, rid)) >= 3)
    policy = real_redis.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        real_redis.config_set("maxmemory-policy", "noeviction")
        real_redis.config_set("maxmemory", 1)
        wait_until(lambda: "event=redis_unavailable" in caplog.text)
        time.sleep(0.3)  # the worker retries meanwhile
    finally:
        real_redis.config_set("maxmemory", 0)
        real_redis.config_set("maxmemory-policy", policy)
    chunks = list(client.stream(rid, timeout=20))
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum((c.token_ids for c in chunks), []) == fake_tokens("full", 50)
    assert "OutOfMemoryError" in caplog.text and worker.alive()


def scrape(port) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples, name, **labels):
    return samples[(name, tuple(sorted({"model_name": "fake", **labels}.items())))]


def test_metrics_endpoint_serves_vllm_names_that_move(start_worker, redis_server, prefix):
    metrics, port = Metrics(model_name="fake"), free_port()
    stop_serving = serve(metrics, port, "127.0.0.1")
    try:
        start_worker(FakeEngine(), metrics=metrics)
        before = scrape(port)
        client = Client(redis_server.url, prefix)
        for prompt in ("ab", "cde", "f"):
            assert client.generate(prompt, max_tokens=5, timeout=10).finish_reason == "length"
        client.redis.xadd(Keys(prefix).requests, {"v": "1", "body": b"\xc1"})  # refused
        wait_until(lambda: metric(scrape(port), "roseinfer:request_success_total",
                                  finished_reason="error") == 1)
        after = scrape(port)
    finally:
        stop_serving()

    def moved(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("roseinfer:prompt_tokens_total") == 6
    assert moved("roseinfer:generation_tokens_total") == 15
    assert moved("roseinfer:request_success_total", finished_reason="length") == 3
    assert moved("roseinfer:request_success_total", finished_reason="stop") == 0
    assert moved("roseinfer:time_to_first_token_seconds_count") == 3
    assert moved("roseinfer:inter_token_latency_seconds_count") == 12
    assert moved("roseinfer:e2e_request_latency_seconds_count") == 3
    assert moved("roseinfer:request_queue_time_seconds_count") == 3
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"roseinfer:{gauge}") == 0  # all done
    assert metric(after, "roseinfer:time_to_first_token_seconds_sum") > 0


def test_status_shows_workers_queue_and_dead_consumers(start_worker, real_redis, prefix, redis_server):
    keys, client = Keys(prefix), Client(redis_server.url, prefix)
    real_redis.xgroup_create(keys.requests, "workers", id="0", mkstream=True)
    client.submit("x", max_tokens=2)
    real_redis.xreadgroup("workers", "gone", {keys.requests: ">"}, count=1)  # then it "died"
    engine = FakeEngine(max_num_seqs=2, step_s=0.05)
    worker = start_worker(engine, consumer="w1", heartbeat_s=0.1)
    held = 2 + QUEUED_PAST_SLOTS  # its slots, and the entries a full worker queues
    for _ in range(held + 3):
        client.submit("a", max_tokens=40)
    wait_until(lambda: any(w["in_flight"] == held
                           for w in status.collect(real_redis, keys, "workers")["workers"]))
    s = status.collect(real_redis, keys, "workers")
    assert (s["waiting"], s["pending"], s["dead"]) == (3, held + 1, 0)
    assert s["oldest_waiting_s"] >= 0
    (w,) = s["workers"]
    assert (w["consumer"], w["status"], w["in_flight"], w["pending"]) == \
        ("w1", "serving", held, held)
    assert w["age_s"] < 1
    assert [(o["consumer"], o["pending"]) for o in s["orphans"]] == [("gone", 1)]
    assert w["step"] == "eager"
    text = status.render(s)
    assert "3 waiting" in text and "w1" in text and "gone: 1 pending" in text and "eager" in text
    worker.stop(grace_s=0)  # hands them back
    assert status.collect(real_redis, keys, "workers")["workers"] == []
