"""A worker whose loop stalls inside admission for longer than --claim-idle-ms, while it
serves other requests: nothing is lost or served twice, alone or beside another worker."""
import time

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import Client

from .conftest import FakeEngine
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
