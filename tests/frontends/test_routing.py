"""Prefix-aware routing (routing.py) on a real Redis: the router's choice, an entry read by one
worker and served by the one holding its prefix, and a routed worker killed mid-run."""
import random
import time
from types import SimpleNamespace

import msgpack
import pytest
import redis

from roseinfer import LLM, SamplingParams
from roseinfer.core.blocks import prompt_hashes, root_hash
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys
from roseinfer.core.errors import ConfigError
from roseinfer.frontends.redis_streams.routing import WATCH_EVERY_S, Forecast, RouteConfig, \
    Router
from roseinfer.frontends.redis_streams.worker import Worker

from .conftest import TINY_ENGINE, WORDS, assert_well_formed, pending, raw_chunks, wait_until
from .test_reliability_processes import START_TIMEOUT_S, alive, drained_log, kill_mid_request

BLOCK = 16


def request(ids, prompt_logprobs=None):
    return SimpleNamespace(prompt=ids, params=SamplingParams(prompt_logprobs=prompt_logprobs),
                           lora=None)


@pytest.fixture
def fleet(real_redis, prefix):
    """fleet(name, blocks held of PROMPT, unfinished, draining=False): a peer's keys."""
    keys = Keys(prefix)

    def add(name, held, unfinished=0, draining=False, max_num_seqs=8, forecast=None,
            age_s=0.0):
        real_redis.sadd(keys.fleet, name)
        if held:
            real_redis.sadd(keys.cached(name), *HASHES[:held])
        real_redis.lpush(keys.roots(name), 7, HASHES[0], 8)  # its prompt among others
        load = {"unfinished": unfinished, "draining": draining, "roots": 3,
                "max_num_seqs": max_num_seqs}
        if forecast is not None:  # a worker that reports what predicting its TTFT reads
            load.update(forecast=forecast.body(), at=time.time() - age_s, heartbeat_s=1.0)
        real_redis.set(keys.load(name), msgpack.packb(load))
    return add


PROMPT = list(range(1000, 1000 + 20 * BLOCK + 5))
HASHES = prompt_hashes(PROMPT, BLOCK)


def router(real_redis, prefix, own=0, min_gain_tokens=2 * BLOCK, own_load=0,
           own_forecast=None, policy="ttft"):
    """A router whose mirror has looked three times: the names, their loads, the roots
    those list."""
    mine = set(HASHES[:own])
    r = Router(real_redis, Keys(prefix), "me", BLOCK, mine.__contains__, lambda: own_load,
               RouteConfig(min_gain_tokens=min_gain_tokens, policy=policy),
               lambda: own_forecast)
    for _ in range(3):
        look(r, real_redis)
    return r


def look(router, real_redis):
    time.sleep(WATCH_EVERY_S)
    pipe = real_redis.pipeline(transaction=False)
    router.watch(pipe)
    router.watched(pipe.execute())


def test_the_router_picks_the_peer_holding_the_longest_prefix(real_redis, prefix, fleet):
    fleet("a", 10)
    fleet("b", 4)
    fleet("me", 20)  # its own name is never a peer
    assert router(real_redis, prefix).place([("1-0", request(PROMPT))]) == {"1-0": "a"}
    # Not enough to gain over what this worker holds itself: it stays.
    assert router(real_redis, prefix, own=9).place([("1-0", request(PROMPT))]) == {}
    assert router(real_redis, prefix, own=3).place([("1-0", request(PROMPT))]) == {"1-0": "a"}
    # A prompt computed whole (prompt_logprobs) gains nothing anywhere; a short one neither.
    assert router(real_redis, prefix).place([("1-0", request(PROMPT, 1)),
                                             ("2-0", request(PROMPT[:BLOCK + 1]))]) == {}


def test_an_adapters_prefix_routes_only_that_adapters_requests(real_redis, prefix):
    """A peer holds PROMPT's blocks as computed under LoRA adapter "sql": a request for
    "sql" goes there, the base model's request for the same prompt does not."""
    keys, rooted = Keys(prefix), prompt_hashes(PROMPT, BLOCK, root_hash("sql"))
    real_redis.sadd(keys.fleet, "a")
    real_redis.sadd(keys.cached("a"), *rooted[:10])
    real_redis.lpush(keys.roots("a"), rooted[0])
    real_redis.set(keys.load("a"), msgpack.packb({"unfinished": 0, "draining": False,
                                                  "roots": 1, "max_num_seqs": 8}))
    r = router(real_redis, prefix)
    sql = SimpleNamespace(prompt=PROMPT, params=SamplingParams(), lora="sql")
    assert r.place([("1-0", sql)]) == {"1-0": "a"}
    assert r.place([("2-0", request(PROMPT))]) == {}


def test_a_loaded_draining_or_dead_peer_gets_nothing(real_redis, prefix, fleet):
    keys = Keys(prefix)
    fleet("a", 10, unfinished=7)
    fleet("b", 6)
    fleet("c", 12, draining=True)
    # One slot left at a: the first entry takes it, the next goes to the second best.
    placed = router(real_redis, prefix, own_load=6).place([("1-0", request(PROMPT)),
                                                           ("2-0", request(PROMPT))])
    assert placed == {"1-0": "a", "2-0": "b"}
    # a runs more than 2 (8 / 8, at least 2) sequences beyond this worker's 4: b gets it.
    assert router(real_redis, prefix, own_load=4).place([("1-0", request(PROMPT))]) == {"1-0": "b"}
    r = router(real_redis, prefix)
    real_redis.delete(keys.load("a"))  # its heartbeat expired
    look(r, real_redis)
    assert r.place([("3-0", request(PROMPT))]) == {"3-0": "b"}
    look(r, real_redis)
    assert real_redis.smembers(keys.fleet) == {b"b", b"c"}  # a is dropped from the fleet


# 2,000 prompt tokens a second and 10 ms steps everywhere; PROMPT is 325 tokens, 320 in
# the 20 blocks a holder caches: 162.5 ms to compute it whole, 2.5 ms for its last 5.
def forecast(running=0, backlog=0, free_in=0):
    return Forecast(running, 8, backlog, free_in, step_s=0.010, prefill_tps=2000.0)


def test_the_holder_busy_but_still_faster_gets_the_entry(real_redis, prefix, fleet):
    """a runs 7 sequences (past the prefix rule's bound of 2 beyond this idle worker),
    with 100 prompt tokens ahead: 50 + 2.5 ms there, plus the 20 ms hand-over, against
    162.5 ms to compute the prompt here."""
    fleet("a", 20, unfinished=7, forecast=forecast(running=7, backlog=100))
    idle = forecast()
    assert router(real_redis, prefix, own_forecast=idle).place(
        [("1-0", request(PROMPT))]) == {"1-0": "a"}
    assert router(real_redis, prefix, own_forecast=idle, policy="prefix").place(
        [("1-0", request(PROMPT))]) == {}


def test_a_holder_so_loaded_that_recomputing_wins_gets_nothing(real_redis, prefix, fleet):
    """Every seat at a taken for 30 more steps (300 ms): computing the prompt here is
    faster, though a holds it."""
    fleet("a", 20, unfinished=8, forecast=forecast(running=8, free_in=30))
    assert router(real_redis, prefix, own_forecast=forecast()).place(
        [("1-0", request(PROMPT))]) == {}


def test_entries_placed_since_a_report_count_as_that_workers_work(real_redis, prefix, fleet):
    """a has two seats free: two entries take them; the third would wait 30 steps for a
    seat there, and is computed here instead."""
    fleet("a", 20, unfinished=6, forecast=forecast(running=6, free_in=30))
    entries = [(f"{i}-0", request(PROMPT)) for i in range(3)]
    assert router(real_redis, prefix, own_forecast=forecast()).place(entries) == {
        "0-0": "a", "1-0": "a"}


def test_a_stale_report_falls_back_to_the_prefix_rule(real_redis, prefix, fleet):
    """a's report is 3 s old, past two of its 1 s heartbeats: the prefix rule decides,
    and a runs too many sequences for it. So does a report without a forecast, and a
    router that has not measured its own rates yet."""
    fleet("a", 20, unfinished=7, forecast=forecast(running=7, backlog=100), age_s=3.0)
    assert router(real_redis, prefix, own_forecast=forecast()).place(
        [("1-0", request(PROMPT))]) == {}
    fleet("a", 20, unfinished=7, forecast=forecast(running=7, backlog=100))
    assert router(real_redis, prefix, own_forecast=None).place(
        [("1-0", request(PROMPT))]) == {}
    with pytest.raises(ConfigError, match="route_policy must be ttft or prefix"):
        RouteConfig(policy="fastest")


def test_a_prompt_no_peer_lists_costs_no_round_trip(real_redis, prefix, fleet, monkeypatch):
    fleet("a", 10)
    r = router(real_redis, prefix)
    monkeypatch.setattr(real_redis, "pipeline", lambda **kw: pytest.fail("a round trip"))
    other = [t + 1 for t in PROMPT]  # its first block is not a's
    assert r.place([("1-0", request(other))]) == {}


def test_an_entry_read_by_one_worker_is_served_by_the_one_holding_its_prefix(
        tiny_llm, tiny_gpt2_dir, redis_server, real_redis, prefix):
    """Two workers stepped by hand: the holder serves a prompt; the other reads its
    follow-up, hands it over without serving it, and the holder serves it from its cache,
    with the tokens an engine alone gives."""
    other_llm = LLM(tiny_gpt2_dir, **TINY_ENGINE, cpu_compiled_step="off")  # see test_lanes
    route = RouteConfig(min_gain_tokens=32)
    holder, other = (Worker(llm.engine, redis.Redis.from_url(redis_server.url), prefix=prefix,
                            consumer=name, block_ms=20, send_thread=False, route=route)
                     for llm, name in ((tiny_llm, "holder"), (other_llm, "other")))
    client = Client(redis_server.url, prefix)
    words = random.Random(prefix).choices(WORDS, k=60)
    history = " ".join(words)
    holder.setup()
    first = client.submit(history + " one", max_tokens=4, temperature=0)
    _run_until_done(holder, client, first)
    other.setup()
    for _ in range(4):  # idle rounds, in which its mirror reads the holder's roots
        other.run_once()
    follow_up = history + " one two three"
    rid = client.submit(follow_up, max_tokens=8, temperature=0, ignore_eos=True)
    for _ in range(3):
        other.run_once()
    assert not other.engine.has_unfinished()
    assert other.metrics.routed._value.get() == 1
    chunks = _run_until_done(holder, client, rid)
    usage = chunks[-1].usage
    assert usage["cached_tokens"] >= usage["prompt_tokens"] - 3 * BLOCK
    ref = tiny_llm.generate([follow_up], SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))[0]
    assert sum((c.token_ids for c in chunks), []) == ref.token_ids
    assert_well_formed(raw_chunks(real_redis, prefix, rid))
    assert pending(real_redis, prefix) == 0
    for w in (holder, other):
        w.stop(0)
        w.run()  # leaves: hands nothing back, removes its keys
    keys = Keys(prefix)
    assert not real_redis.exists(keys.fleet, keys.cached("holder"), keys.load("other"))


def _run_until_done(worker, client, rid, limit=200):
    for _ in range(limit):
        worker.run_once()
        chunks = raw_chunks(client.redis, client.keys.prefix, rid)
        if chunks and chunks[-1].finished:
            worker.run_once()  # sends the ack
            return chunks
    raise AssertionError(f"{rid} did not finish")


@pytest.fixture
def worker_processes(worker_process, redis_server):
    return lambda consumer, *flags: worker_process(redis_server.url, consumer, *flags)


def test_a_routed_worker_killed_mid_run_loses_nothing(
        tiny_llm, worker_processes, real_redis, prefix, redis_server):
    """Follow-ups of one history go to the worker holding it, also from the other worker;
    it is killed while serving them, and the other resumes each: every request completes
    with greedy decoding's tokens, each seq once."""
    flags = ("--claim-idle-ms", "1000", "--route-min-gain-tokens", "32")
    holder = worker_processes("holder", *flags)
    wait_until(lambda: alive(real_redis, prefix, "holder"), START_TIMEOUT_S)
    client = Client(redis_server.url, prefix)
    history = " ".join(random.Random(prefix).choices(WORDS, k=60))
    client.generate(history + " zero", max_tokens=2, temperature=0, timeout=60)
    survivor = worker_processes("survivor", *flags)
    wait_until(lambda: alive(real_redis, prefix, "holder", "survivor"), START_TIMEOUT_S)
    time.sleep(3.5)  # three idle reads of 1 s: the survivor's mirror lists the holder's roots
    rng = random.Random(2)
    reqs = [(f"{history} {' '.join(rng.choices(WORDS, k=3))}",
             {"max_tokens": rng.randint(150, 180), "temperature": 0, "ignore_eos": True})
            for _ in range(12)]
    rids = []
    for p, kw in reqs:  # one at a time: each wakes the idle survivor, which routes it
        rids.append(client.submit(p, **kw))
        time.sleep(0.05)

    kill_mid_request(real_redis, prefix, holder, "holder", timeout=60)
    log = drained_log(tiny_llm, client, real_redis, prefix, rids, reqs, survivor, timeout=90)
    assert "event=routed" in log and "event=resumed" in log
