"""Worker step logic on fakeredis with the fake engine, one run_once() at a time (no BLOCK
reliance: fakeredis returns at once from a blocking XREADGROUP with COUNT)."""
import msgpack
import pytest

from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys, decode_chunk
from roseinfer.frontends.redis_streams.worker import QUEUED_PAST_SLOTS, Worker

from .conftest import run_until_idle

PREFIX = "u"
KEYS = Keys(PREFIX)


@pytest.fixture
def client(fake_redis):
    return Client(prefix=PREFIX, redis_client=fake_redis)


@pytest.fixture
def worker(fake_engine, fake_redis):
    w = Worker(fake_engine, fake_redis, prefix=PREFIX, consumer="c1", block_ms=1, send_thread=False)
    w.setup()
    return w


def chunks(redis, rid):
    return [decode_chunk(f) for _, f in redis.xrange(KEYS.out(rid))]


def pending(redis):
    return redis.xpending(KEYS.requests, "workers")["pending"]


def test_one_request_end_to_end(worker, client, fake_redis):
    rid = client.submit("ab", max_tokens=4)
    run_until_idle(worker)
    got = chunks(fake_redis, rid)
    assert [c.seq for c in got] == [0, 1, 2, 3]
    assert [c.finish_reason for c in got] == [None, None, None, "length"]
    # "a" = 97 % 100 -> 97, "b" -> 98; the toy model continues 99, 0, 1, 2
    assert sum((c.token_ids for c in got), []) == [99, 0, 1, 2]
    assert "".join(c.text for c in got) == "vabc"
    assert got[-1].usage == {"prompt_tokens": 2, "completion_tokens": 4, "cached_tokens": 0}
    assert pending(fake_redis) == 0 and fake_redis.xlen(KEYS.requests) == 0  # acked and deleted
    assert 0 < fake_redis.ttl(KEYS.out(rid)) <= 3600


def test_stream_interval_holds_back_all_but_first_and_last(worker, client, fake_redis):
    rid = client.submit("a", max_tokens=8, stream_interval=3)
    run_until_idle(worker)
    assert [len(c.token_ids) for c in chunks(fake_redis, rid)] == [1, 3, 3, 1]


def test_finishing_on_a_stop_token(worker, client, fake_redis):
    rid = client.submit([10], max_tokens=10, stop_token_ids=[13])
    run_until_idle(worker)
    got = chunks(fake_redis, rid)
    assert got[-1].finish_reason == "stop" and got[-1].usage["completion_tokens"] == 3


def test_reads_as_many_entries_as_free_slots_then_a_few_to_queue(worker, client, fake_redis,
                                                                 fake_engine):
    """Free slots first; once full, entries until QUEUED_PAST_SLOTS wait in the engine (a
    bad one among them is refused at once); the rest stay in the stream for others."""
    slots = fake_engine.config.max_num_seqs
    for _ in range(slots + QUEUED_PAST_SLOTS + 3):
        client.submit("a", max_tokens=50)
    worker.run_once()
    assert fake_engine.num_unfinished() == pending(fake_redis) == slots == 4
    worker.run_once()
    assert fake_engine.num_unfinished() == pending(fake_redis) == slots + QUEUED_PAST_SLOTS
    worker.run_once()
    assert fake_redis.xlen(KEYS.requests) - pending(fake_redis) == 3
    run_until_idle(worker)
    assert pending(fake_redis) == 0


def test_bad_entries_get_an_error_and_do_not_disturb_the_batch(worker, client, fake_redis):
    good = [client.submit("ab", max_tokens=5) for _ in range(2)]
    undecodable = fake_redis.xadd(KEYS.requests, {"v": "1", "body": b"\xc1"}).decode()
    fake_redis.xadd(KEYS.requests, {"v": "1", "rid": "bad-ids",
                                    "body": msgpack.packb({"prompt_token_ids": [5, 100]})})
    client.submit("a" * 60, rid="long", max_tokens=10)
    shell = fake_redis.xadd(KEYS.requests, {"prompt": "a", "max_tokens": "2"}).decode()
    run_until_idle(worker)
    for rid in good:
        assert chunks(fake_redis, rid)[-1].finish_reason == "length"
    assert [c.token_ids for c in chunks(fake_redis, shell)] == [[98], [99]]
    for rid, code, field in [(undecodable, "bad_request", "body"),
                             ("bad-ids", "bad_request", "prompt_token_ids"),
                             ("long", "too_long", "prompt")]:
        (err,) = chunks(fake_redis, rid)
        assert (err.seq, err.finish_reason, err.error["code"]) == (0, "error", code)
        assert err.error["message"].startswith(f"{field}:")
    assert pending(fake_redis) == 0


def test_engine_bug_in_add_request_costs_only_that_request(worker, client, fake_redis, fake_engine):
    real_add = fake_engine.add_request

    def add(rid, prompt, params, emitted_ids=None, emitted_text=None):
        if rid == "boom":
            raise RuntimeError("kaput")
        real_add(rid, prompt, params, emitted_ids, emitted_text)

    fake_engine.add_request = add
    client.submit("a", rid="boom")
    ok = client.submit("a", max_tokens=2)
    run_until_idle(worker)
    (err,) = chunks(fake_redis, "boom")
    assert err.error == {"code": "internal", "message": "RuntimeError: kaput"}
    assert chunks(fake_redis, ok)[-1].finish_reason == "length"


def test_duplicate_rid_in_flight_is_refused_on_the_entry_stream(worker, client, fake_redis):
    client.submit("a", rid="same", max_tokens=6)
    worker.run_once()
    second = fake_redis.xadd(KEYS.requests, {"v": "1", "rid": "same",
                                              "body": msgpack.packb({"prompt": "b"})}).decode()
    run_until_idle(worker)
    assert [c.seq for c in chunks(fake_redis, "same")] == list(range(6))
    (err,) = chunks(fake_redis, second)
    assert err.error["message"].startswith("rid:")


def test_cancel_in_flight_and_before_admission(worker, client, fake_redis, fake_engine):
    running = client.submit("a", max_tokens=50)
    worker.run_once()  # admitted
    worker.run_once()  # first token
    client.cancel(running)
    client.cancel("queued")  # cancelled before any worker read it
    client.submit("a", rid="queued", max_tokens=50)
    run_until_idle(worker, limit=10)
    for rid in (running, "queued"):
        got = chunks(fake_redis, rid)
        assert got[-1].finish_reason == "abort" and len(got[-1].token_ids) == 0
        assert [c.seq for c in got] == list(range(len(got)))
        assert got[-1].usage["completion_tokens"] < 5
    assert pending(fake_redis) == 0 and fake_engine.num_unfinished() == 0


def test_cancels_sent_before_the_worker_started_are_not_replayed(fake_engine, fake_redis, client):
    client.cancel("old")
    w = Worker(fake_engine, fake_redis, prefix=PREFIX, block_ms=1, send_thread=False)
    w.setup()
    client.submit("a", rid="old", max_tokens=3)
    run_until_idle(w)
    assert chunks(fake_redis, "old")[-1].finish_reason == "length"


def test_stop_drains_in_flight_requests_and_reads_no_more(worker, client, fake_redis):
    first = client.submit("a", max_tokens=5)
    worker.run_once()
    later = client.submit("a", max_tokens=5)
    worker.stop(grace_s=60)
    worker.run()  # returns once the in-flight request finished
    assert chunks(fake_redis, first)[-1].finish_reason == "length"
    assert chunks(fake_redis, later) == [] and fake_redis.xlen(KEYS.requests) == 1


def test_one_round_trip_per_step(worker, client, fake_redis, monkeypatch):
    for _ in range(3):
        client.submit("a", max_tokens=8)
    for _ in range(3):  # admission, then an ownership check and its refresh
        worker.run_once()
    executes, commands = [], []
    real_pipeline = fake_redis.pipeline

    def pipeline(**kwargs):
        pipe = real_pipeline(**kwargs)
        real_execute = pipe.execute
        pipe.execute = lambda **k: executes.append(len(pipe)) or real_execute(**k)
        return pipe

    monkeypatch.setattr(fake_redis, "pipeline", pipeline)
    monkeypatch.setattr(fake_redis, "execute_command", lambda *a, **k: commands.append(a))
    worker.run_once()
    # 3 chunks in one script call, then the cancel and request reads
    assert executes == [1 + 2] and commands == []
