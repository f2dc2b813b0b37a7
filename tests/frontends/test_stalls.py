"""A worker whose loop stalls inside admission for longer than --claim-idle-ms, while it
serves other requests: nothing is lost or served twice, alone or beside another worker."""
import threading
import time

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import Client

from .conftest import FakeEngine, assert_well_formed, pending, raw_chunks, wait_until
from .test_reliability import fake_tokens

STALL_S = 1.2
CLAIM_IDLE_MS = 300
SLOW = 19  # max_tokens that marks the request whose admission stalls


class SlowAdmission:
    """An engine whose add_request blocks the loop for a request of max_tokens SLOW (as
    a huge prefill's set-up, or swapping, would)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, rid, prompt, params, *args, **kwargs):
        if params.max_tokens == SLOW:
            time.sleep(STALL_S)
        return self._engine.add_request(rid, prompt, params, *args, **kwargs)


def stream_all(client, rids):
    """Each request's tokens, checking that its client saw every seq once, in order."""
    results = {}
    for rid in rids:
        chunks = list(client.stream(rid, timeout=30))
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
        results[rid] = sum((c.token_ids for c in chunks), [])
    return results


def test_a_stall_past_the_claim_threshold_loses_nothing(tiny_llm, start_worker, redis_server,
                                                        prefix, caplog):
    worker = start_worker(SlowAdmission(tiny_llm.engine), claim_idle_ms=CLAIM_IDLE_MS,
                          chat_template=False)
    client = Client(redis_server.url, prefix)
    prompts = ["The capital of France is", "slow and steady", "a red fox jumps"]
    rids = [client.submit(prompts[0], max_tokens=40, temperature=0)]
    time.sleep(0.2)  # the first one is decoding when the stall begins
    rids += [client.submit(prompts[1], max_tokens=SLOW, temperature=0),
             client.submit(prompts[2], max_tokens=40, temperature=0)]
    got = stream_all(client, rids)
    worker.stop()
    expected = tiny_llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0)
                                           for n in (40, SLOW, 40)])
    assert [got[r] for r in rids] == [e.token_ids for e in expected]
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert "event=slow_iteration" in events


def test_a_stall_beside_another_worker_loses_nothing(start_worker, redis_server, prefix):
    start_worker(SlowAdmission(FakeEngine(step_s=0.01)), consumer="stalling",
                 claim_idle_ms=CLAIM_IDLE_MS)
    client = Client(redis_server.url, prefix)
    rids = [client.submit("ab", max_tokens=60)]
    time.sleep(0.2)
    rids += [client.submit("slow", max_tokens=SLOW), client.submit("cd", max_tokens=60)]
    start_worker(FakeEngine(step_s=0.01), consumer="other", claim_idle_ms=CLAIM_IDLE_MS)
    got = stream_all(client, rids)
    assert [got[r] for r in rids] == [fake_tokens("ab", 60), fake_tokens("slow", SLOW),
                                      fake_tokens("cd", 60)]


class StallingStep:
    """An engine whose step blocks once for ``stall_s`` when ``stall`` is set: the worker
    is frozen mid-flight, as a SIGSTOP or a swapped-out process would be, and wakes with
    that step's outputs to publish."""

    def __init__(self, engine, stall_s):
        self._engine, self.stall_s = engine, stall_s
        self.stall = threading.Event()
        self.stalled = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if self.stall.is_set() and not self.stalled.is_set():
            self.stalled.set()
            time.sleep(self.stall_s)
        return self._engine.step()


def test_a_worker_woken_after_a_takeover_writes_nothing_into_streams_it_lost(
        start_worker, redis_server, real_redis, prefix, caplog):
    """12 requests in flight; the worker freezes past the claim threshold; a second one
    takes them over and finishes them; the first wakes with a step's chunks to publish.
    The fence drops them: no chunk after a final one, no seq twice."""
    zombie = StallingStep(FakeEngine(max_num_seqs=12, step_s=0.01), stall_s=2.5)
    start_worker(zombie, consumer="zombie", claim_idle_ms=CLAIM_IDLE_MS)
    client = Client(redis_server.url, prefix)
    rids = [client.submit(f"r{i}", max_tokens=50) for i in range(12)]
    wait_until(lambda: all(len(raw_chunks(real_redis, prefix, r)) >= 3 for r in rids))
    zombie.stall.set()
    zombie.stalled.wait(5)
    start_worker(FakeEngine(max_num_seqs=12, step_s=0.01), consumer="heir",
                 claim_idle_ms=CLAIM_IDLE_MS)
    got = stream_all(client, rids)
    time.sleep(zombie.stall_s)  # the zombie wakes and sends what it had
    wait_until(lambda: pending(real_redis, prefix) == 0)
    for i, rid in enumerate(rids):
        chunks = raw_chunks(real_redis, prefix, rid)  # as written: a repeat would show
        assert_well_formed(chunks)
        assert got[rid] == fake_tokens(f"r{i}", 50)
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert "event=fenced" in events and "event=ownership_lost" in events
