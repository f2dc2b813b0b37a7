"""Oversized and odd entries against a real Redis, mixed with valid requests: each hostile
entry gets its final chunk at once and costs no more than a length check, the valid ones
complete with the right tokens, and the worker stays alive and small."""
import os
import time

import msgpack
import psutil
import pytest

from roseinfer import SamplingParams
from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys

from .conftest import raw_chunks

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
