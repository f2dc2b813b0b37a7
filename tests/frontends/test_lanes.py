"""Background work (priority > 0) through the backlog (lanes.py) on a real Redis: the move
into the request stream, and a worker full of background work serving an interactive
request first."""
import time

from roseinfer import LLM, SamplingParams
from roseinfer.frontends.redis_streams import status
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.lanes import Backlog
from roseinfer.frontends.redis_streams.protocol import Keys

from .conftest import TINY_ENGINE, assert_well_formed, raw_chunks, wait_until


def promote(r, keys, slots, max_wait_s=60.0):
    pipe = r.pipeline(transaction=False)
    Backlog(keys, "workers", max_wait_s).promote(pipe, slots)
    return pipe.execute()[0]


def test_the_backlog_moves_as_much_as_there_is_room_for(real_redis, prefix):
    keys = Keys(prefix)
    real_redis.xgroup_create(keys.requests, "workers", id="0", mkstream=True)
    client = Client(redis_client=real_redis, prefix=prefix)
    rids = [client.submit("x", priority=3) for _ in range(5)]
    assert real_redis.xlen(keys.backlog) == 5 and real_redis.xlen(keys.requests) == 0
    queued = [i.decode() for i, _ in real_redis.xrange(keys.backlog)]
    client.submit("now")  # priority 0: straight to the request stream
    assert status.collect(real_redis, keys, "workers")["backlog"] == 5
    assert promote(real_redis, keys, 3) == [2, 3]  # room: 3 slots less 1 unread
    assert promote(real_redis, keys, 3) == [0, 3]  # 3 unread now: no room
    moved = [f for _, f in real_redis.xrange(keys.requests)][1:]
    assert [f[b"rid"].decode() for f in moved] == rids[:2]
    assert [f[b"backlog_id"].decode() for f in moved] == queued[:2]  # their time queued
    time.sleep(0.06)
    # Waited 60 ms: not 3 (its priority) x 50 ms, but 3 x 10 ms; the head moves regardless.
    assert promote(real_redis, keys, 0, max_wait_s=0.05) == [0, 3]
    assert promote(real_redis, keys, 0, max_wait_s=0.01) == [1, 2]


def final_entry_id(r, prefix, rid) -> tuple:
    [(entry, _)] = r.xrevrange(Keys(prefix).out(rid), count=1)
    return tuple(int(part) for part in entry.decode().split("-"))


def test_a_worker_full_of_background_work_serves_an_interactive_request_first(
        tiny_llm, tiny_gpt2_dir, start_worker, redis_server, real_redis, prefix):
    """Two slots, both running priority-10 requests: a priority-0 request is read beside
    them, takes a slot, and ends first; the background requests then end with the tokens
    they have alone (recomputed after giving their slot up)."""
    client = Client(redis_server.url, prefix)
    long = {"max_tokens": 240, "temperature": 0, "ignore_eos": True}  # n_positions 256
    # Its own compiled CPU step off: two engines of one model building it at once in one
    # process have failed a step (not seen with one engine per process, as workers run).
    two_slots = LLM(tiny_gpt2_dir, **{**TINY_ENGINE, "max_num_seqs": 2, "cpu_compiled_step": "off"})
    start_worker(two_slots.engine)
    prompts = ["one two three", "four five six"]
    background = [client.submit(p, priority=10, **long) for p in prompts]
    wait_until(lambda: all(len(raw_chunks(real_redis, prefix, r)) >= 3 for r in background), 60)
    rid = client.submit("seven eight", max_tokens=4, temperature=0, ignore_eos=True)
    final = list(client.stream(rid, timeout=60))[-1]
    assert final.finish_reason == "length"
    assert two_slots.engine.stats().num_preemptions >= 1  # a background one gave its slot up
    for r, p in zip(background, prompts):
        chunks = list(client.stream(r, timeout=120))
        # Ended after the interactive one, by Redis's own clock: what the client sees once
        # it has read its reply may lag the worker on a loaded machine.
        assert final_entry_id(real_redis, prefix, r) > final_entry_id(real_redis, prefix, rid)
        ref = tiny_llm.generate([p], SamplingParams(**long))[0]
        assert sum((c.token_ids for c in chunks), []) == ref.token_ids
        assert_well_formed(raw_chunks(real_redis, prefix, r))


def test_redis_cli_background_work_without_a_rid_answers_on_its_backlog_id(
        tiny_llm, start_worker, real_redis, prefix):
    keys = Keys(prefix)
    start_worker(tiny_llm.engine)
    entry = real_redis.xadd(keys.backlog, {"prompt": "hello", "max_tokens": "3",
                                           "priority": "1"}).decode()
    wait_until(lambda: (c := raw_chunks(real_redis, prefix, entry)) and c[-1].finished, 30)
    assert_well_formed(raw_chunks(real_redis, prefix, entry))
    assert real_redis.xlen(keys.backlog) == 0


def test_background_and_interactive_requests_added_at_once_keep_their_own_replies(
        start_worker, real_redis, prefix):
    """The backlog and the request stream give IDs from one clock, so a background request
    and an interactive one added in the same millisecond got the same ID: without a rid of
    its own the background one answered on the other's reply stream."""
    from .conftest import FakeEngine

    start_worker(FakeEngine(max_num_seqs=8))
    client = Client(prefix=prefix, redis_client=real_redis)
    prompts = [chr(ord("a") + i) * 3 for i in range(16)]
    rids = [client.submit(p, max_tokens=2, priority=i % 2) for i, p in enumerate(prompts)]
    assert len(set(rids)) == len(rids)
    for p, rid in zip(prompts, rids):
        chunks = list(client.stream(rid, timeout=30))
        assert chunks[-1].usage["prompt_tokens"] == len(p)
        assert [c.token_ids for c in chunks][0] == [(ord(p[-1]) + 1) % FakeEngine.vocab_size]
