"""The worker against a real redis-server: the real engine on a tiny random GPT-2, checked
against LLM.generate, plus blocking behaviour that fakeredis cannot show."""
import asyncio
import random
import time

import msgpack
import pytest

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import AsyncClient, Client, RequestFailed
from roseinfer.frontends.redis_streams.protocol import Keys

from .conftest import CODE, WORDS, assert_well_formed, raw_chunks, wait_until


def mixed_requests(n, rng):
    reqs = []
    for i in range(n):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
        params = {"max_tokens": rng.randint(1, 40), "stream_interval": rng.choice([1, 1, 3, 7])}
        if i % 3:
            params["temperature"] = 0
        else:
            params.update(temperature=0.8, top_p=0.9, top_k=rng.choice([0, 20]), seed=i)
        if i % 5 == 0:
            prompt = [rng.randrange(50257) for _ in range(rng.randint(1, 20))]
        reqs.append((prompt, params))
    return reqs


def test_concurrent_mixed_requests_match_llm_generate(tiny_llm, start_worker, real_redis, prefix, redis_server):
    reqs = mixed_requests(24, random.Random(0))
    worker = start_worker(tiny_llm.engine)

    async def run_all():
        async with AsyncClient(redis_server.url, prefix) as client:
            return await asyncio.gather(*(client.generate(p, timeout=30, **kw) for p, kw in reqs))

    results = asyncio.run(run_all())
    worker.stop()
    for result, (prompt, params) in zip(results, reqs):
        assert_well_formed(raw_chunks(real_redis, prefix, result.rid))
        assert result.finish_reason in ("length", "stop")
        assert len(result.token_ids) == params["max_tokens"] or result.finish_reason == "stop"
    greedy = [(r, p, kw) for r, (p, kw) in zip(results, reqs) if kw.get("temperature") == 0]
    expected = tiny_llm.generate([p for _, p, _ in greedy],
                                 [SamplingParams(max_tokens=kw["max_tokens"], temperature=0)
                                  for _, _, kw in greedy])
    for (result, _, _), ref in zip(greedy, expected):
        assert (result.token_ids, result.text, result.finish_reason) == \
            (ref.token_ids, ref.text, ref.finish_reason)
        cached = result.usage.pop("cached_tokens")
        assert 0 <= cached < len(ref.prompt_token_ids)
        assert result.usage == {"prompt_tokens": len(ref.prompt_token_ids),
                                "completion_tokens": len(ref.token_ids)}


def test_logprobs_and_penalties_through_redis(tiny_llm, start_worker, redis_server, prefix):
    """Chunks carry one logprob entry per id, equal to the engine's own; penalized and
    plain requests share the worker's batches."""
    worker = start_worker(tiny_llm.engine)
    asks = [dict(logprobs=3, repetition_penalty=1.4, logit_bias={262: 5.0}, stream_interval=3),
            dict(logprobs=0, frequency_penalty=1.0, presence_penalty=0.5), {}]
    prompts = ["Once upon a time", "The sea", "A cat"]

    async def run_all():
        async with AsyncClient(redis_server.url, prefix) as client:
            return await asyncio.gather(*(client.generate(p, timeout=30, max_tokens=9,
                                                          temperature=0, **kw)
                                          for p, kw in zip(prompts, asks)))
    results = asyncio.run(run_all())
    worker.stop()  # the references below use the same engine
    for result, prompt, kw in zip(results, prompts, asks):
        engine_kw = {k: v for k, v in kw.items() if k != "stream_interval"}
        (ref,) = tiny_llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0,
                                                            **engine_kw))
        assert result.token_ids == ref.token_ids
        if "logprobs" not in kw:
            assert result.logprobs is None
            continue
        assert len(result.logprobs) == len(result.token_ids)
        for got, want in zip(result.logprobs, ref.logprobs):
            assert abs(got["logprob"] - want.logprob) < 1e-5
            assert [t for t, _ in got["top_logprobs"]] == [t for t, _ in want.top]


def test_prompt_logprobs_through_redis(tiny_llm, start_worker, redis_server, prefix):
    """The first chunk carries one entry per prompt token (nil first), equal to the
    engine's own; asked for from Python and as a redis-cli string field."""
    worker = start_worker(tiny_llm.engine)
    prompt = "Once upon a time there was"
    with Client(redis_server.url, prefix) as client:
        result = client.generate(prompt, timeout=30, max_tokens=4, temperature=0,
                                 prompt_logprobs=2, stream_interval=2)
        plain = client.generate(prompt, timeout=30, max_tokens=4, temperature=0)
        fields = {"prompt": prompt, "max_tokens": "4", "temperature": "0",
                  "prompt_logprobs": "0"}
        rid = client.redis.xadd(Keys(prefix).requests, fields).decode()
        shell = [c.prompt_logprobs for c in client.stream(rid, timeout=30)]
    worker.stop()  # the reference below uses the same engine
    (ref,) = tiny_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                        prompt_logprobs=2))
    assert plain.prompt_logprobs is None
    assert all(c is None for c in shell[1:])  # the first chunk only
    shell = shell[0]
    assert result.prompt_logprobs[0] is None and shell[0] is None
    assert len(result.prompt_logprobs) == len(ref.prompt_logprobs) == len(shell)
    tok = tiny_llm.tokenizer
    for got, short, want in zip(result.prompt_logprobs[1:], shell[1:],
                                ref.prompt_logprobs[1:]):
        assert abs(got["logprob"] - want.logprob) < 1e-5
        assert abs(short["logprob"] - want.logprob) < 1e-5 and short["top_logprobs"] == []
        assert [t for t, _ in got["top_logprobs"]] == [t for t, _ in want.top]
        assert got["token"] == tok.decode([want.token_id])


def test_structured_output_through_redis(tiny_llm, start_worker, redis_server, prefix):
    """response_format from Python (a msgpack map) and redis-cli (a JSON string field)
    gives the engine's own constrained output; a pattern that does not compile is a
    bad_request naming the field."""
    import json
    import re

    fmt = CODE
    start_worker(tiny_llm.engine)
    with Client(redis_server.url, prefix) as client:
        result = client.generate("Your code:", timeout=30, max_tokens=20, temperature=0,
                                 response_format=fmt)
        rid = client.redis.xadd(Keys(prefix).requests, {
            "prompt": "Your code:", "max_tokens": "20", "temperature": "0",
            "response_format": json.dumps(fmt)}).decode()
        shell = "".join(c.text for c in client.stream(rid, timeout=30))
        with pytest.raises(RequestFailed, match="response_format") as bad:
            client.generate("x", timeout=30, response_format={"type": "regex", "pattern": "(a"})
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", result.text) and shell == result.text
    assert result.finish_reason == "stop"
    assert bad.value.code == "bad_request"


def test_n_samples_stream_on_one_reply_stream(tiny_llm, start_worker, real_redis, redis_server,
                                              prefix):
    """n = 3 seeded samples: each equals the engine's own sample of that index; chunks
    carry their index, seq runs on across samples, each sample ends in its own final chunk,
    and the entry is acknowledged after the last."""
    prompt = "Once upon a time"
    params = dict(n=3, max_tokens=9, temperature=1.0, seed=4, stream_interval=2)
    worker = start_worker(tiny_llm.engine)
    with Client(redis_server.url, prefix) as client:
        results = client.generate(prompt, timeout=30, **params)
        rid = client.submit(prompt, **params)
        streamed = list(client.stream(rid, timeout=30, n=3))
    wait_until(lambda: real_redis.xpending(Keys(prefix).requests, "workers")["pending"] == 0)
    worker.stop()  # the reference below uses the same engine
    templated = tiny_llm.engine.chat_prompt(prompt)
    want = tiny_llm.generate([templated], SamplingParams(**{k: v for k, v in params.items()
                                                            if k != "stream_interval"}))[0]
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.token_ids for r in results] == [w.token_ids for w in want]
    assert [r.text for r in results] == [w.text for w in want]
    assert [r.usage["completion_tokens"] for r in results] == [9, 9, 9]
    assert len({tuple(r.token_ids) for r in results}) == 3
    assert_well_formed(raw_chunks(real_redis, prefix, rid), n=3)
    assert streamed == raw_chunks(real_redis, prefix, rid)


def test_cancel_mid_generation_aborts_and_frees_the_slot(tiny_llm, start_worker, real_redis, prefix, redis_server):
    start_worker(tiny_llm.engine)
    client = Client(redis_server.url, prefix)
    rid = client.submit("Once upon a time", max_tokens=240, ignore_eos=True, temperature=0)
    chunks = []
    for chunk in client.stream(rid, timeout=30):
        chunks.append(chunk)
        if chunk.seq == 2:
            client.cancel(rid)
    assert chunks[-1].finish_reason == "abort"
    assert 3 <= chunks[-1].usage["completion_tokens"] < 240
    assert_well_formed(raw_chunks(real_redis, prefix, rid))
    wait_until(lambda: real_redis.xpending(Keys(prefix).requests, "workers")["pending"] == 0)
    assert tiny_llm.engine.num_unfinished() == 0
    assert client.generate("after", max_tokens=3, timeout=30).finish_reason == "length"


def test_flood_of_malformed_entries_leaves_valid_requests_complete(tiny_llm, start_worker, real_redis, prefix, redis_server):
    keys, client = Keys(prefix), Client(redis_server.url, prefix)
    bad_bodies = [b"\xc1", b"\x92\x01", msgpack.packb([1]), msgpack.packb({"max_tokens": 3}),
                  msgpack.packb({"prompt": "x", "prompt_token_ids": [1]}),
                  msgpack.packb({"prompt_token_ids": [1, 99999]}),
                  msgpack.packb({"prompt": "x", "temperature": "hot"}),
                  msgpack.packb({"prompt": "x", "stop": 7}),
                  msgpack.packb({"prompt": "word " * 300}),  # longer than the model's context
                  msgpack.packb({"prompt": ""})]
    good, bad = [], []
    for i in range(40):
        body = bad_bodies[i % len(bad_bodies)]
        bad.append(real_redis.xadd(keys.requests, {"v": "1", "body": body}).decode())
        if i % 4 == 0:
            good.append(client.submit(f"request {i}", max_tokens=5, temperature=0))
    bad.append(real_redis.xadd(keys.requests, {"v": "9", "prompt": "x"}).decode())
    bad.append(real_redis.xadd(keys.requests, {"prompt": "x", "max_tokens": "lots"}).decode())
    worker = start_worker(tiny_llm.engine)
    for rid in good:
        assert [c.finish_reason for c in client.stream(rid, timeout=30)][-1] == "length"
    for rid in bad:
        (err,) = list(client.stream(rid, timeout=30))
        assert err.finish_reason == "error" and err.error["code"] in ("bad_request", "too_long")
    assert worker.alive()
    wait_until(lambda: real_redis.xpending(keys.requests, "workers")["pending"] == 0)
    assert client.generate("still alive", max_tokens=2, timeout=30).finish_reason == "length"


def test_idle_worker_blocks_instead_of_spinning(fake_engine, start_worker, real_redis, prefix, redis_server):
    start_worker(fake_engine, block_ms=2000)
    time.sleep(0.3)
    real_redis.config_resetstat()
    time.sleep(1.0)
    calls = real_redis.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)
    assert calls <= 2  # one blocking read per block_ms, not a busy loop
    # ...and a blocked worker wakes up as soon as a request arrives
    started = time.monotonic()
    assert Client(redis_server.url, prefix).generate("a", max_tokens=2, timeout=5).text
    assert time.monotonic() - started < 1.0


def test_worker_survives_a_flush(fake_engine, start_worker, real_redis, prefix, redis_server):
    worker = start_worker(fake_engine)
    client = Client(redis_server.url, prefix)
    assert client.generate("a", max_tokens=2, timeout=5).finish_reason == "length"
    real_redis.delete(Keys(prefix).requests)  # the group goes with the stream
    time.sleep(0.3)
    assert client.generate("a", max_tokens=2, timeout=5).finish_reason == "length"
    assert worker.alive()


def test_speculating_worker_streams_plain_tokens(tiny_llm, tiny_gpt2_dir, start_worker,
                                                 real_redis, prefix, redis_server):
    """Drafted rounds come out as chunks of several tokens: seq stays contiguous, the
    tokens are the plain engine's, a request may turn drafts off, and the spec_decode
    counters move."""
    from roseinfer import LLM
    from roseinfer.frontends.redis_streams.metrics import Metrics
    from tests.test_speculative import Oracle, registry

    from .conftest import TINY_ENGINE

    rng = random.Random(3)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(2, 12))] for _ in range(6)]
    plain = tiny_llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    Oracle.references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    spec = LLM(tiny_gpt2_dir, plugins=registry(), speculative="oracle", **TINY_ENGINE)
    metrics = Metrics(model_name="tiny")
    worker = start_worker(spec.engine, metrics=metrics)
    client = Client(redis_server.url, prefix)
    results = [client.generate(p, max_tokens=30, temperature=0, stream_interval=i % 3 + 1,
                               speculative=i != 5, timeout=30) for i, p in enumerate(prompts)]
    worker.stop()
    for result, ref in zip(results, plain):
        assert_well_formed(raw_chunks(real_redis, prefix, result.rid))
        assert result.token_ids == ref.token_ids
    drafted = metrics.spec_draft_tokens._value.get()
    accepted = metrics.spec_accepted._value.get()
    assert 0 < accepted < drafted
    assert metrics.spec_acceptance._value.get() == pytest.approx(accepted / drafted)
