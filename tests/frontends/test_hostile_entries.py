"""Oversized and odd entries against a real Redis, mixed with valid requests: each hostile
entry gets its final chunk at once and costs no more than a length check, the valid ones
complete with the right tokens, and the worker stays alive and small."""
import os
import time

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings

from roseinfer import SamplingParams
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.plugins import PluginRegistry
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys

from tests.edge_values import edge_params

from .conftest import assert_well_formed, pending, raw_chunks, wait_until

MIB = 1 << 20


def hostile_entries():
    """(name, fields, expected error code); the tiny model's context is 256 tokens."""
    def body(**b):
        return {"v": "1", "body": msgpack.packb(b)}
    return [
        ("entry over --max-entry-bytes", body(prompt="hello " * (3 * MIB)), "too_long"),
        ("shell form over it", {"prompt": "x" * (5 * MIB)}, "too_long"),
        ("prompt past the context at any tokens", body(prompt="hello " * 200_000), "too_long"),
        ("a million prompt ids", body(prompt_token_ids=[7] * 1_000_000), "too_long"),
        ("ten thousand stop strings", body(prompt="hi", stop=["a"] * 10_000), "bad_request"),
        ("stop ids by the hundred thousand", body(prompt="hi", stop_token_ids=[1] * 100_000),
         "bad_request"),
        ("NaN temperature", body(prompt="hi", temperature=float("nan")), "bad_request"),
        ("infinite top_p", body(prompt="hi", top_p=float("inf")), "bad_request"),
    ]


def test_a_flood_of_hostile_entries_beside_valid_requests(tiny_llm, start_worker, real_redis,
                                                          redis_server, prefix):
    worker = start_worker(tiny_llm.engine, chat_template=False)
    client = Client(redis_server.url, prefix)
    rss_before = psutil.Process(os.getpid()).memory_info().rss
    valid, hostile = [], []
    prompts = ["The capital of France is", "a red fox", "what is the capital"]
    for i, (name, fields, code) in enumerate(hostile_entries() * 2):
        entry_id = real_redis.xadd(Keys(prefix).requests, fields).decode()
        hostile.append((name, entry_id, code, time.monotonic()))
        if i % 3 == 0:
            prompt = prompts[len(valid) % len(prompts)]
            valid.append((client.submit(prompt, max_tokens=12, temperature=0), prompt))
    for name, entry_id, code, sent in hostile:
        (chunk,) = list(client.stream(entry_id, timeout=10))
        assert (chunk.finish_reason, chunk.error["code"]) == ("error", code), name
        assert time.monotonic() - sent < 2.0, name
        assert len(chunk.error["message"]) < 400, name  # never the client's megabytes back
    results = [list(client.stream(rid, timeout=30)) for rid, _ in valid]
    worker.stop()  # before LLM.generate: one engine, one caller at a time
    expected = tiny_llm.generate([p for _, p in valid], SamplingParams(max_tokens=12, temperature=0))
    for chunks, ref in zip(results, expected):
        assert sum((c.token_ids for c in chunks), []) == ref.token_ids
        assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert worker.alive() is False and worker.error is None
    growth = psutil.Process(os.getpid()).memory_info().rss - rss_before
    assert growth < 500 * MIB, f"RSS grew by {growth / MIB:.0f} MiB"
    assert real_redis.xlen(Keys(prefix).requests) == 0  # every entry answered and acked


@pytest.mark.parametrize("field,value", [("temperature", float("nan")),
                                         ("temperature", float("inf")),
                                         ("top_p", float("nan")), ("min_p", float("-inf"))])
def test_sampling_params_refuse_non_finite_numbers_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_memory_comes_back_after_a_huge_entry(tiny_llm, start_worker, real_redis, redis_server,
                                              prefix):
    start_worker(tiny_llm.engine, chat_template=False)
    client = Client(redis_server.url, prefix)
    assert client.generate("warm up", max_tokens=2, timeout=10).finish_reason == "length"
    rss = psutil.Process(os.getpid()).memory_info().rss
    huge = {"v": "1", "body": msgpack.packb({"prompt": "hello " * (9 * MIB)})}  # 54 MiB
    entry_id = real_redis.xadd(Keys(prefix).requests, huge).decode()
    del huge
    (chunk,) = list(client.stream(entry_id, timeout=20))
    assert chunk.error["code"] == "too_long"
    assert client.generate("after", max_tokens=2, timeout=10).finish_reason == "length"
    growth = psutil.Process(os.getpid()).memory_info().rss - rss
    assert growth < 200 * MIB, f"RSS stayed {growth / MIB:.0f} MiB up"


def test_a_full_worker_refuses_bad_entries_before_its_requests_end(tiny_llm, start_worker,
                                                                  real_redis, redis_server,
                                                                  prefix):
    """Every slot taken by a long request, then a few valid requests and hostile entries
    interleaved: each refusal is written before any running request ends, by the entry
    IDs of the final chunks (Redis's clock). A worker that read only into free slots
    refused them after."""
    start_worker(tiny_llm.engine, chat_template=False)
    client = Client(redis_server.url, prefix)
    slots = tiny_llm.engine.config.max_num_seqs
    running = [client.submit(f"long request {i}", max_tokens=200, temperature=0,
                             ignore_eos=True) for i in range(slots)]
    wait_until(lambda: all(real_redis.xlen(Keys(prefix).out(r)) for r in running), 30)
    bad = []
    for i in range(3):  # the valid ones among them wait, fewer than QUEUED_PAST_SLOTS
        client.submit(f"queued {i}", max_tokens=2)
        for name, fields, _ in hostile_entries()[-2:]:
            bad.append(real_redis.xadd(Keys(prefix).requests, fields).decode())
    for entry_id in bad:
        (chunk,) = list(client.stream(entry_id, timeout=30))
        assert chunk.error["code"] == "bad_request"
    refused = max(real_redis.xrevrange(Keys(prefix).out(e), count=1)[0][0] for e in bad)
    for rid in running:
        chunks = list(client.stream(rid, timeout=60))
        assert chunks[-1].finish_reason == "length"
        ended = real_redis.xrevrange(Keys(prefix).out(rid), count=1)[0][0]
        assert _entry_id(refused) < _entry_id(ended), "a refusal waited for a free slot"


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, seq = raw.decode().split("-")
    return int(ms), int(seq)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(edge=edge_params())
def test_each_field_at_its_edges_through_a_worker(edge, tiny_llm, start_worker, real_redis,
                                                  redis_server, prefix):
    """Each entry ends with tokens or one refusal within 2 s; its batch-mate is served exactly."""
    global _EDGE_WORKER
    expected = _mate_tokens(tiny_llm)
    if _EDGE_WORKER is None or not _EDGE_WORKER.alive():  # one worker for every example
        _EDGE_WORKER = start_worker(tiny_llm.engine, chat_template=False)
    client = Client(redis_server.url, prefix)
    body = {"v": "1", "body": msgpack.packb({"prompt": "the red fox", **edge})}
    sent = time.monotonic()
    entry_id = real_redis.xadd(Keys(prefix).requests, body).decode()
    mate = client.submit("a red fox", max_tokens=8, temperature=0, ignore_eos=True)
    chunks = list(client.stream(entry_id, timeout=30))
    assert time.monotonic() - sent < 2.0, edge
    if chunks[-1].finish_reason == "error":
        assert len(chunks) == 1 and chunks[0].error["code"] == "bad_request", (edge, chunks)
    else:
        n = edge.get("n", 1)
        assert_well_formed(chunks, n)
        assert {c.finish_reason for c in chunks if c.finished} <= {"stop", "length"}
    mate_ids = sum((c.token_ids for c in client.stream(mate, timeout=30)), [])
    assert mate_ids == expected, edge
    assert real_redis.xlen(Keys(prefix).dead) == 0


_EDGE_WORKER = None
_MATE = []


def _mate_tokens(llm):
    """The batch-mate's tokens served alone, by the engine the worker will run (computed
    before the worker starts: one caller at a time)."""
    if not _MATE:
        _MATE.append(llm.generate([llm.tokenizer.encode("a red fox")], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids)
    return _MATE[0]


def test_a_request_that_breaks_its_step_fails_alone(tiny_gpt2_dir, start_worker, real_redis,
                                                     redis_server, prefix):
    """A logits processor that raises inside the batch's step, on one request of 16: that
    one ends with an internal error, the other 15 get their tokens, nothing is redelivered."""
    from roseinfer import LLM
    from tests.test_faults import FusePlugin

    from .conftest import TINY_ENGINE

    reg = PluginRegistry(load_entry_points=False)
    reg.register(FusePlugin(), name="fuse")
    llm = LLM(tiny_gpt2_dir, plugins=reg, **{**TINY_ENGINE, "max_num_seqs": 16})
    prompts = [f"the {w} fox" for w in "red lazy big small old new hot cold".split()] * 2
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate([llm.tokenizer.encode(p) for p in prompts],
                                                   greedy)]
    start_worker(llm.engine, chat_template=False)
    client = Client(redis_server.url, prefix)
    fuse = {"fuse": {"after": 3, "where": "apply"}}
    rids = [client.submit(p, max_tokens=10, temperature=0, ignore_eos=True,
                          logits_processors=fuse if i == 5 else None)
            for i, p in enumerate(prompts)]
    results = [list(client.stream(rid, timeout=30)) for rid in rids]
    bad = results[5][-1]
    assert bad.finish_reason == "error" and bad.error["code"] == "internal"
    assert "the fuse blew" in bad.error["message"]
    for i, chunks in enumerate(results):
        if i != 5:
            assert_well_formed(chunks)
            assert sum((c.token_ids for c in chunks), []) == expected[i], i
    wait_until(lambda: pending(real_redis, prefix) == 0)
    assert real_redis.xlen(Keys(prefix).dead) == 0


def burst_entries():
    """The hostile kinds of a burst that once lost the valid request added between the last
    two: (name, fields, expected error code)."""
    def body(**b):
        return {"v": "1", "body": msgpack.packb(b)}
    return [
        ("a million prompt ids", body(prompt_token_ids=[7] * 1_000_000), "too_long"),
        ("a 50 MB prompt", body(prompt="x" * (50 * MIB)), "too_long"),
        ("100,000 stop strings", body(prompt="hi", stop=["a"] * 100_000), "bad_request"),
        ("a NaN", body(prompt="hi", temperature=float("nan")), "bad_request"),
        ("an inf", body(prompt="hi", top_p=float("inf")), "bad_request"),
        ("a 10,000-character rid", {"v": "1", "rid": "r" * 10_000,
                                    "body": msgpack.packb({"prompt": "hi"})}, "bad_request"),
        ("the shell form with max_tokens 4.0", {"prompt": "hi", "max_tokens": "4.0"},
         "bad_request"),
        # 100,000 one-element arrays around a nil: deeper than any msgpack decoder goes
        ("100,000 nested arrays", {"v": "1", "body": b"\x91" * 100_000 + b"\xc0"},
         "bad_request"),
    ]


@pytest.mark.parametrize("worker_first", [True, False], ids=["read-as-sent", "read-at-once"])
def test_every_entry_of_a_hostile_burst_is_accounted_for(tiny_llm, start_worker, real_redis,
                                                         redis_server, prefix, caplog,
                                                         worker_first):
    """Hostile entries with a valid request after each, then four more, sent to a running
    worker or queued before it starts: each hostile one gets its refusal, each valid one
    its tokens, and the worker's log names each entry once, as admitted or rejected;
    nothing is left in the stream or pending."""
    caplog.set_level("INFO", logger="roseinfer.worker")
    if worker_first:
        worker = start_worker(tiny_llm.engine, chat_template=False)
    keys = Keys(prefix)
    client = Client(redis_server.url, prefix)
    hostile, valid = {}, {}
    for i in range(12):
        if i < len(burst_entries()):
            name, fields, code = burst_entries()[i]
            hostile[real_redis.xadd(keys.requests, fields).decode()] = (name, code)
        prompt = f"valid request {i}"
        valid[client.submit(prompt, max_tokens=8, temperature=0, ignore_eos=True)] = prompt
    if not worker_first:
        worker = start_worker(tiny_llm.engine, chat_template=False)
    for entry_id, (name, code) in hostile.items():
        (chunk,) = list(client.stream(entry_id, timeout=30))
        assert chunk.error["code"] == code, name
    got = {rid: sum((c.token_ids for c in client.stream(rid, timeout=60)), []) for rid in valid}
    worker.stop()
    want = tiny_llm.generate(list(valid.values()), SamplingParams(max_tokens=8, temperature=0,
                                                                  ignore_eos=True))
    assert list(got.values()) == [w.token_ids for w in want]
    lines = [r.getMessage() for r in caplog.records]
    for entry_id in [*hostile, *valid]:
        told = [m for m in lines if f"entry={entry_id} " in m + " "
                and m.startswith(("event=admitted", "event=rejected"))]
        assert len(told) == 1, (entry_id, told)
    assert real_redis.xlen(keys.requests) == 0 and pending(real_redis, prefix) == 0
