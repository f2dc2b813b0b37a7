"""Resume, dead-lettering, ownership and outages one step at a time, on fakeredis with the
fake engine. Another consumer's crash is staged by hand: it read the entry, wrote some
chunks, and its entry went idle."""
import argparse
import logging
import os
import time

import pytest
from redis.exceptions import ConnectionError, ResponseError

from roseinfer.core.config import EngineConfig
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.commands import worker_settings
from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.outage import GaveUp, Outage, is_transient
from roseinfer.frontends.redis_streams.protocol import Chunk, Keys, chunk_body, decode_chunk, \
    encode_chunk
from roseinfer.frontends.redis_streams.worker import EngineFailed, Worker

from .conftest import FakeEngine, assert_well_formed, raw_chunks, run_until_idle

PREFIX = "u"
KEYS = Keys(PREFIX)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_worker(engine, redis, consumer="c1", **kwargs):
    w = Worker(engine, redis, prefix=PREFIX, consumer=consumer, block_ms=1, send_thread=False,
               **kwargs)
    w.setup()
    return w


@pytest.fixture
def worker(fake_engine, fake_redis):
    return make_worker(fake_engine, fake_redis)


@pytest.fixture
def client(fake_redis):
    return Client(prefix=PREFIX, redis_client=fake_redis)


def crashed_owner(redis, rid, chunks, deliveries=1):
    """Stage a dead consumer that read the entry of ``rid`` and published ``chunks``."""
    (_, [(entry_id, _)]), = redis.xreadgroup("workers", "dead", {KEYS.requests: ">"}, count=1)
    for c in chunks:
        redis.xadd(KEYS.out(rid), encode_chunk(c))
    redis.xclaim(KEYS.requests, "workers", "dead", 0, [entry_id], idle=60_000,
                 retrycount=deliveries, justid=True)
    return entry_id.decode()


def owner_of(redis, entry_id):
    (p,) = redis.xpending_range(KEYS.requests, "workers", entry_id, entry_id, 1)
    return p["consumer"].decode(), p["times_delivered"], p["time_since_delivered"]


@pytest.mark.parametrize("failed_tries", [1, 3])
def test_chunks_a_failover_lost_go_again_before_the_next(worker, client, fake_redis,
                                                          failed_tries):
    """The Redis that comes back after an outage lacks the reply stream's first chunks
    (taken by a primary that died before its replica had them): they are sent again,
    ahead of the next, so the stream has every seq in order; also when the tries that
    first carried them failed too (a failover takes several)."""
    client.submit("ab", rid="r", max_tokens=6)
    for _ in range(3):
        worker.run_once()
    assert raw_chunks(fake_redis, PREFIX, "r")
    fake_redis.delete(KEYS.out("r"))  # never replicated
    fail_round_trips(worker.outbox.redis, failed_tries)
    run_until_idle(worker)
    chunks = raw_chunks(fake_redis, PREFIX, "r")
    kept = Client(prefix=PREFIX, redis_client=fake_redis).stream("r")
    assert sum((c.token_ids for c in kept), []) == [99, 0, 1, 2, 3, 4]
    assert chunks[0].seq == 0


def fail_round_trips(redis, tries: int) -> None:
    """The next ``tries`` pipelines of ``redis`` fail as if its primary had died."""
    real_pipeline = redis.pipeline
    failures = [ConnectionError("primary gone")] * tries

    def pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        execute = pipe.execute

        def failing(*a, **k):
            if failures:
                raise failures.pop()
            return execute(*a, **k)
        pipe.execute = failing
        return pipe

    redis.pipeline = pipeline


def test_chunks_a_resumed_request_builds_on_go_again_if_a_failover_lost_them(
        worker, client, fake_redis):
    """This worker took over a dead worker's request after reading its chunks from a
    primary that then died before its replica had the last of them: the new primary's
    stream stops before them. The dead worker cannot send them again; this one does,
    ahead of its own, so the client sees every seq in order."""
    client.submit("ab", rid="r", max_tokens=6)
    crashed_owner(fake_redis, "r", [Chunk("r", 0, [99], "v"), Chunk("r", 1, [0, 1], "ab")])
    worker.run_once()
    assert worker._inflight["r"].seq == 2  # resumed after the dead worker's two chunks
    worker.run_once()
    for entry_id, fields in fake_redis.xrange(KEYS.out("r")):  # lost in the failover
        if decode_chunk(fields).seq >= 1:
            fake_redis.xdel(KEYS.out("r"), entry_id)
    fail_round_trips(worker.outbox.redis, 1)
    run_until_idle(worker)
    chunks = list(Client(prefix=PREFIX, redis_client=fake_redis).stream("r"))
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum((c.token_ids for c in chunks), []) == [99, 0, 1, 2, 3, 4]


def test_an_entry_whose_delivery_a_failover_lost_keeps_streaming_from_its_worker(
        fake_engine, fake_redis, client):
    """The Redis that comes back lost the record that the entry was delivered at all: this
    worker's refresh of it fails, and the same round reads it again as new. It goes on
    serving it: dropped, it came back with its rid still in the engine, and ended in an
    error chunk of seq 0 that its client dropped as seen, waiting for the rest forever."""
    worker = make_worker(fake_engine, fake_redis, claim_idle_ms=100)
    rid = client.submit("ab", max_tokens=8)
    for _ in range(3):
        worker.run_once()
    assert rid in worker._inflight
    fake_redis.xack(KEYS.requests, "workers", rid)  # in no worker's pending list
    fake_redis.xgroup_setid(KEYS.requests, "workers", "0")  # and not delivered yet
    time.sleep(0.05)  # its refresh is due in the next round
    run_until_idle(worker)
    chunks = raw_chunks(fake_redis, PREFIX, rid)
    assert_well_formed(chunks)
    assert chunks[-1].finish_reason == "length" and chunks[-1].error is None


def test_an_entry_a_failover_delivers_again_to_its_worker_keeps_streaming(worker, client,
                                                                           fake_redis):
    """The Redis that comes back lost the record that the entry was delivered: this worker,
    which serves it, reads it again as new. It goes on serving it, with no error chunk."""
    rid = client.submit("ab", max_tokens=6)
    for _ in range(3):
        worker.run_once()
    assert rid in worker._inflight
    fake_redis.xgroup_setid(KEYS.requests, "workers", "0")  # deliver it again
    run_until_idle(worker)
    chunks = raw_chunks(fake_redis, PREFIX, rid)
    assert_well_formed(chunks)
    assert sum((c.token_ids for c in chunks), []) == [99, 0, 1, 2, 3, 4]
    assert fake_redis.xlen(KEYS.requests) == 0


def test_a_dead_workers_request_resumes_after_its_last_chunk(worker, client, fake_redis):
    client.submit("ab", rid="r", max_tokens=6)
    # "b" is 98: the toy model goes 99, 0, 1, 2, 3, 4; the dead worker sent 3 of them,
    # the last chunk twice (at-least-once), and its client read "vab"
    crashed_owner(fake_redis, "r", [Chunk("r", 0, [99], "v"), Chunk("r", 1, [0, 1], "ab"),
                                    Chunk("r", 1, [0, 1], "ab")])
    run_until_idle(worker)
    kept = Client(prefix=PREFIX, redis_client=fake_redis).stream("r")
    chunks = list(kept)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum((c.token_ids for c in chunks), []) == [99, 0, 1, 2, 3, 4]
    assert "".join(c.text for c in chunks) == "vabcde"
    assert chunks[-1].usage == {"prompt_tokens": 2, "completion_tokens": 6, "cached_tokens": 0}
    assert fake_redis.xlen(KEYS.requests) == 0  # acknowledged and deleted
    assert worker.metrics.resumed._value.get() == 1


def test_an_n_sample_request_resumes_only_its_unfinished_samples(tiny_llm, client, fake_redis):
    """The dead worker sent sample 0 one token, sample 1 none and sample 2 all of its own:
    the taker runs samples 0 and 1 from where they stop, and not sample 2 again."""
    from roseinfer import SamplingParams

    prompt = [464, 3290, 286, 4881, 318]
    greedy = tiny_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    g, text = greedy.token_ids, [tiny_llm.tokenizer.decode([t]) for t in greedy.token_ids]
    taker = make_worker(tiny_llm.engine, fake_redis)
    client.submit(prompt, rid="r", n=3, max_tokens=4, temperature=0, ignore_eos=True)
    usage = {"prompt_tokens": 5, "completion_tokens": 4}
    crashed_owner(fake_redis, "r", [Chunk("r", 0, g[:1], text[0], index=0),
                                    Chunk("r", 1, g, "".join(text), "length", usage, index=2)])
    run_until_idle(taker)
    chunks = raw_chunks(fake_redis, PREFIX, "r")
    assert_well_formed(chunks, n=3)
    for i in range(3):
        mine = [c for c in chunks if c.index == i]
        assert sum((c.token_ids for c in mine), []) == g
        assert "".join(c.text for c in mine) == greedy.text
    assert fake_redis.xlen(KEYS.requests) == 0  # acknowledged after the last sample


def test_a_request_that_had_finished_is_only_acknowledged(worker, client, fake_redis):
    client.submit("ab", rid="r", max_tokens=2)
    done = Chunk("r", 1, [0], "a", "length", {"prompt_tokens": 2, "completion_tokens": 2})
    crashed_owner(fake_redis, "r", [Chunk("r", 0, [99], "v"), done])  # died before its ack
    run_until_idle(worker)
    assert len(raw_chunks(fake_redis, PREFIX, "r")) == 2
    assert fake_redis.xlen(KEYS.requests) == 0 and worker.engine.added == []


def test_an_entry_delivered_too_often_goes_to_dead_with_a_final_error(fake_engine, fake_redis, client):
    w = make_worker(fake_engine, fake_redis, max_deliveries=2)
    client.submit("ab", rid="r", max_tokens=6)
    entry_id = crashed_owner(fake_redis, "r", [Chunk("r", 0, [99], "v")], deliveries=2)
    run_until_idle(w)  # its claim is delivery 3
    chunks = raw_chunks(fake_redis, PREFIX, "r")
    assert_well_formed(chunks)
    assert (chunks[-1].seq, chunks[-1].error["code"]) == (1, "dead_letter")
    (_, dead), = fake_redis.xrange(KEYS.dead)
    assert (dead[b"dead_entry_id"].decode(), dead[b"dead_deliveries"], dead[b"rid"]) == \
        (entry_id, b"3", b"r")
    assert fake_redis.xlen(KEYS.requests) == 0 and fake_engine.added == []


def taken_over(engine, redis, client):
    """A worker two steps into request "r", which another consumer then claims after the
    worker stalled past the claim threshold; returns the worker and the entry ID."""
    w = make_worker(engine, redis, claim_idle_ms=100)
    client.submit("a", rid="r", max_tokens=40)
    w.run_once()
    w.run_once()
    entry_id = redis.xrange(KEYS.requests)[0][0]
    time.sleep(0.15)
    redis.xautoclaim(KEYS.requests, "workers", "other", 100)
    return w, entry_id


def test_an_entry_claimed_by_another_worker_is_dropped_silently(fake_engine, fake_redis, client):
    w, entry_id = taken_over(fake_engine, fake_redis, client)
    sent = len(raw_chunks(fake_redis, PREFIX, "r"))
    for _ in range(3):
        w.run_once()
    assert len(raw_chunks(fake_redis, PREFIX, "r")) <= sent + 1  # the step in the air, at most
    assert not w._inflight and not fake_engine.has_unfinished()
    assert owner_of(fake_redis, entry_id)[0] == "other"


def test_a_live_worker_keeps_its_entries_past_the_claim_threshold(fake_engine, fake_redis, client):
    w = make_worker(fake_engine, fake_redis, claim_idle_ms=100)
    client.submit("a", rid="r", max_tokens=40)
    for _ in range(12):  # 0.24 s of decoding, 2.4 claim thresholds
        w.run_once()
        time.sleep(0.02)
        assert fake_redis.xautoclaim(KEYS.requests, "workers", "other", 100)[1] == []
    entry_id = fake_redis.xrange(KEYS.requests)[0][0]
    assert owner_of(fake_redis, entry_id)[:2] == ("c1", 1)  # refreshes are not deliveries


def test_stop_hands_unfinished_entries_back_without_counting_a_delivery(fake_redis, client):
    first = make_worker(FakeEngine(), fake_redis)
    client.submit("ab", rid="r", max_tokens=30)
    for _ in range(4):
        first.run_once()
    first.stop(grace_s=0)
    first.run()
    entry_id = fake_redis.xrange(KEYS.requests)[0][0]
    consumer, deliveries, idle_ms = owner_of(fake_redis, entry_id)
    assert (consumer, deliveries) == ("c1", 0) and idle_ms >= 60_000  # claimable at once
    second = make_worker(FakeEngine(), fake_redis, consumer="c2")
    run_until_idle(second)
    chunks = raw_chunks(fake_redis, PREFIX, "r")
    assert_well_formed(chunks)
    assert sum((c.token_ids for c in chunks), []) == [(99 + i) % 100 for i in range(30)]
    assert fake_redis.get(KEYS.worker("c1")) is None  # its heartbeat went with it


def test_a_broken_engine_stops_the_worker_and_counts_no_delivery(fake_engine, fake_redis, client):
    w = make_worker(fake_engine, fake_redis)
    client.submit("ab", rid="r", max_tokens=30)
    w.run_once()

    def broken():
        raise RuntimeError("device lost")

    fake_engine.step = broken
    with pytest.raises(EngineFailed, match="restart this worker"):
        w.run()
    entry_id = fake_redis.xrange(KEYS.requests)[0][0]
    assert owner_of(fake_redis, entry_id)[:2] == ("c1", 0)  # handed back, not its fault


def test_outage_retries_logs_once_each_way_and_gives_up_when_told(caplog):
    caplog.set_level(logging.INFO, logger="roseinfer.worker")
    failures = iter([ConnectionError("refused"), ResponseError("LOADING loading"), None])

    def flaky():
        error = next(failures)
        if error is not None:
            raise error
        return "ok"

    outages = []
    assert Outage(lambda: False, lambda: outages.append(1)).call(flaky) == "ok"
    assert [r.getMessage().split()[0] for r in caplog.records] == \
        ["event=redis_unavailable", "event=redis_back"]
    assert outages == [1]
    with pytest.raises(GaveUp):
        Outage(lambda: True).call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
    with pytest.raises(ResponseError):  # a real error is not waited out
        Outage(lambda: False).call(lambda: (_ for _ in ()).throw(ResponseError("WRONGTYPE x")))


def test_transient_replies_are_told_apart_as_redis_py_raises_them():
    """redis-py turns some error codes into classes of its own, cutting the code from the
    message: each reply is parsed by redis-py itself, not built by hand."""
    from redis._parsers.base import BaseParser

    parse = BaseParser.parse_error
    for reply in ["OOM command not allowed when used memory > 'maxmemory'.",
                  "READONLY You can't write against a read only replica.",
                  "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is no",
                  "LOADING Redis is loading the dataset in memory", "TRYAGAIN Multiple keys",
                  "MISCONF Redis is configured to save RDB snapshots", "CLUSTERDOWN down",
                  "NOREPLICAS Not enough good replicas to write."]:
        assert is_transient(parse(reply)), reply
    for reply in ["NOGROUP No such key", "WRONGTYPE Operation against a key",
                  "ERR unknown command"]:
        assert not is_transient(parse(reply)), reply


def test_the_cluster_clients_node_table_race_is_transient():
    """The error Python raises when redis-py's node table changes under a reader thread
    (as in a failover's window) is tried again; other RuntimeErrors are not."""
    table = {"a": 1, "b": 2}
    with pytest.raises(RuntimeError) as race:
        for key in table:
            table[key + "'"] = table.pop(key)
    assert is_transient(race.value)
    assert not is_transient(RuntimeError("the engine failed"))


def test_worker_settings_come_from_flags_then_the_config_file_then_defaults(tmp_path):
    config = tmp_path / "roseinfer.toml"
    config.write_text('[engine]\nmax_num_seqs = 4\n[worker]\nclaim_idle_ms = 5000\ngrace_s = 9.5\n')
    args = argparse.Namespace(config=str(config), grace_s=3.0, claim_idle_ms=None, prefix=None)
    s = worker_settings(args)
    assert (s["claim_idle_ms"], s["grace_s"], s["max_deliveries"], s["prefix"]) == \
        (5000, 3.0, 5, "roseinfer")
    config.write_text('[worker]\nclaim_idle = 5\n')
    with pytest.raises(SystemExit, match=r"unknown key\(s\) \['claim_idle'\].*claim_idle_ms"):
        worker_settings(args)


def test_the_example_deploy_config_loads():
    args = argparse.Namespace(config=os.path.join(REPO, "deploy", "roseinfer.toml"))
    assert EngineConfig.from_toml(args.config).max_num_seqs == 256
    assert worker_settings(args)["claim_idle_ms"] == 30_000


def test_events_are_logfmt_lines(caplog):
    caplog.set_level(logging.INFO, logger="roseinfer.worker")
    event("finished", rid="r-1", e2e_s=0.12345, error='bad "x" = y', entry=b"1-0")
    assert caplog.records[-1].getMessage() == \
        'event=finished rid=r-1 e2e_s=0.123 error="bad \\"x\\" = y" entry=1-0'


def test_a_worker_stopped_after_a_takeover_hands_back_nothing_it_lost(fake_engine, fake_redis,
                                                                      client):
    """The fence covers hand-backs too: handing back an entry another worker took over
    would make it claimable again while that worker still serves it."""
    w, entry_id = taken_over(fake_engine, fake_redis, client)
    w.stop(grace_s=0)  # before its next refresh: it still believes the entry its own
    w.run()
    consumer, deliveries, idle_ms = owner_of(fake_redis, entry_id)
    assert (consumer, deliveries) == ("other", 2) and idle_ms < 60_000


@pytest.mark.parametrize("then_vouch", [False, True], ids=["read", "read_then_takeover"])
def test_an_outage_longer_than_the_replay_window_still_replays_when_a_read_lands_first(
        fake_redis, monkeypatch, then_vouch):
    """A failover takes longer than REPLAY_S. The reader thread's read (no writes) may land
    before the sender's next round, and a takeover may vouch for another stream's chunks:
    the chunks of the seconds before the outage must still go again with the next round.
    Aged out by either, they were not sent again, and a chunk the old primary never
    replicated left a hole in seq."""
    from types import SimpleNamespace

    from roseinfer.frontends.redis_streams import outbox as outbox_module
    from roseinfer.frontends.redis_streams.outbox import REPLAY_S, Outbox
    from roseinfer.frontends.redis_streams.ownership import Fence

    clock = [100.0]
    monkeypatch.setattr(outbox_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    box = Outbox(fake_redis, Outage(lambda: False), Fence(KEYS.requests, None, "c1"),
                 send_thread=False)
    key = KEYS.out("r")
    box.publish(key, chunk_body(Chunk("r", 0, [5], "a")), "1-0", 0)
    box.post()
    fake_redis.delete(key)  # the old primary never replicated it
    clock[0] += REPLAY_S + 1  # the failover's window
    fail_round_trips(fake_redis, 1)
    box.post(lambda pipe: pipe.ping(), lambda replies, at: None)  # a read lands first
    box.deliver()
    if then_vouch:
        box.vouch(KEYS.out("taken"), "2-0", [(chunk_body(Chunk("taken", 0, [7], "c")), 0)])
    box.publish(key, chunk_body(Chunk("r", 1, [6], "b")), "1-0", 1)
    box.post()
    assert [c.seq for c in raw_chunks(fake_redis, PREFIX, "r")] == [0, 1]
