"""`roseinfer worker` processes on the tiny GPT-2 and a real Redis: one killed with SIGKILL
mid-flight (the other resumes its requests), one stopped with SIGTERM mid-batch."""
import random
import signal

import pytest

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
from roseinfer.frontends.redis_streams.worker import QUEUED_PAST_SLOTS
from roseinfer.frontends.redis_streams.protocol import Keys

from .conftest import WORDS, assert_well_formed, pending, raw_chunks, wait_until

START_TIMEOUT_S = 90  # torch and the model load in each worker process


@pytest.fixture
def worker_processes(worker_process, redis_server):
    """start(consumer, *flags) -> a `roseinfer worker` process; all are gone after the test."""
    return lambda consumer, *flags: worker_process(redis_server.url, consumer, *flags)


def greedy_requests(n, rng, max_tokens):
    return [(" ".join(rng.choices(WORDS, k=rng.randint(1, 20))),
             {"max_tokens": rng.randint(*max_tokens), "temperature": 0, "ignore_eos": True,
              "stream_interval": rng.choice([1, 3])}) for _ in range(n)]


def assert_match_llm_generate(llm, real_redis, prefix, rids, reqs):
    expected = llm.generate([p for p, _ in reqs],
                            [SamplingParams(max_tokens=kw["max_tokens"], temperature=0, ignore_eos=True)
                             for _, kw in reqs])
    for rid, ref in zip(rids, expected):
        chunks = raw_chunks(real_redis, prefix, rid)  # as written: duplicates would show
        assert_well_formed(chunks)
        assert sum((c.token_ids for c in chunks), []) == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert chunks[-1].finish_reason == ref.finish_reason


def alive(real_redis, prefix, *consumers):
    return {b["consumer"] for b in read_heartbeats(real_redis, Keys(prefix))} >= set(consumers)


@pytest.mark.parametrize("flags", [(), ("--speculative", "ngram")], ids=["plain", "speculating"])
def test_kill_9_mid_flight_the_other_worker_resumes_without_gap_or_repeat(
        tiny_llm, worker_processes, real_redis, prefix, redis_server, flags):
    """Speculating workers too (the tiny GPT-2's greedy output loops, so prompt lookup
    drafts most of it): chunks of several tokens resume as exactly as single ones."""
    victim = worker_processes("victim", "--claim-idle-ms", "1000", *flags)
    survivor = worker_processes("survivor", "--claim-idle-ms", "1000", *flags)
    wait_until(lambda: alive(real_redis, prefix, "victim", "survivor"), START_TIMEOUT_S)
    # More than one worker takes (its 8 slots and the QUEUED_PAST_SLOTS a full one
    # queues), so that each holds some whichever reads first.
    reqs = greedy_requests(8 + QUEUED_PAST_SLOTS + 2, random.Random(1), (60, 120))
    client = Client(redis_server.url, prefix)
    rids = [client.submit(p, **kw) for p, kw in reqs]  # no rid given: rid = entry ID
    kill_mid_request(real_redis, prefix, victim, "victim")
    assert "event=resumed" in drained_log(tiny_llm, client, real_redis, prefix, rids, reqs,
                                          survivor)


def kill_mid_request(real_redis, prefix, proc, consumer, timeout=30):
    """SIGKILL the worker process ``proc`` once one of its entries is part-way streamed."""
    keys = Keys(prefix)

    def mid_request():
        owned = real_redis.xpending_range(keys.requests, "workers", "-", "+", 100,
                                          consumername=consumer)
        progress = [raw_chunks(real_redis, prefix, p["message_id"].decode()) for p in owned]
        return any(len(c) >= 2 and not c[-1].finished for c in progress)

    wait_until(mid_request, timeout)
    proc.kill()
    proc.wait()


def drained_log(llm, client, real_redis, prefix, rids, reqs, survivor, timeout=60) -> str:
    """Every request ends with greedy decoding's tokens, each seq once; then the surviving
    worker drains on SIGTERM and exits 0. Returns its log."""
    for rid in rids:
        assert list(client.stream(rid, timeout=timeout))[-1].finish_reason == "length"
    assert_match_llm_generate(llm, real_redis, prefix, rids, reqs)
    wait_until(lambda: pending(real_redis, prefix) == 0)
    survivor.send_signal(signal.SIGTERM)
    _, log = survivor.communicate(timeout=30)
    assert survivor.returncode == 0, log
    return log


def test_a_tensor_parallel_worker_serves_and_a_dead_rank_hands_its_requests_back(
        tiny_llm, worker_processes, real_redis, prefix, redis_server):
    """A worker over two gloo ranks streams the same tokens as one process; when its
    rank 1 is killed the whole worker exits with an error naming it, and the
    other worker resumes its requests as after any crash. The other starts once the
    rank is dead: started before, it could take every request first (it reads as
    soon as it is up, and a one-process worker is up sooner)."""
    import psutil

    keys = Keys(prefix)
    victim = worker_processes("tp", "--claim-idle-ms", "1000", "--tensor-parallel-size", "2")
    wait_until(lambda: alive(real_redis, prefix, "tp"), START_TIMEOUT_S)
    reqs = greedy_requests(8, random.Random(3), (60, 120))
    client = Client(redis_server.url, prefix)
    rids = [client.submit(p, **kw) for p, kw in reqs]

    def tp_mid_request():
        owned = real_redis.xpending_range(keys.requests, "workers", "-", "+", 100, consumername="tp")
        progress = [raw_chunks(real_redis, prefix, p["message_id"].decode()) for p in owned]
        return any(len(c) >= 2 and not c[-1].finished for c in progress)

    wait_until(tp_mid_request, 60)
    (rank1,) = psutil.Process(victim.pid).children()
    rank1.kill()
    assert victim.wait(timeout=30) != 0
    survivor = worker_processes("survivor", "--claim-idle-ms", "1000")
    for rid in rids:
        assert list(client.stream(rid, timeout=START_TIMEOUT_S))[-1].finish_reason == "length"
    assert_match_llm_generate(tiny_llm, real_redis, prefix, rids, reqs)
    assert "tensor-parallel rank 1" in victim.stderr.read()
    survivor.send_signal(signal.SIGTERM)
    _, log = survivor.communicate(timeout=30)
    assert "event=resumed" in log


def test_sigterm_during_a_batch_finishes_it_and_exits_0(tiny_llm, worker_processes, real_redis, prefix, redis_server):
    keys = Keys(prefix)
    worker = worker_processes("w", "--grace-s", "60")
    wait_until(lambda: alive(real_redis, prefix, "w"), START_TIMEOUT_S)
    reqs = greedy_requests(4, random.Random(2), (80, 120))
    client = Client(redis_server.url, prefix)
    rids = [client.submit(p, **kw) for p, kw in reqs]
    wait_until(lambda: all(raw_chunks(real_redis, prefix, rid) for rid in rids), 30)
    worker.send_signal(signal.SIGTERM)
    # Once it says it is draining (or is gone), it reads nothing more.
    wait_until(lambda: worker.poll() is not None or
               any(b["status"] == "draining" for b in read_heartbeats(real_redis, keys)), 10)
    late = client.submit("too late", max_tokens=5)
    _, log = worker.communicate(timeout=60)
    assert worker.returncode == 0, log
    assert_match_llm_generate(tiny_llm, real_redis, prefix, rids, reqs)  # all finished
    assert pending(real_redis, prefix) == 0  # every finished entry acknowledged
    assert real_redis.xlen(keys.requests) == 1 and raw_chunks(real_redis, prefix, late) == []
    assert "event=stopped" in log and "handed_back=0" in log
    assert read_heartbeats(real_redis, keys) == []
