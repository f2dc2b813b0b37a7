"""Embeddings, scores and classes through a real Redis worker (task embed, score,
classify): the Python client's results equal the engine's own, a rerank goes through, and
bad inputs are refused by name with nothing left pending; a generate worker and a pooling
worker each refuse the other's tasks."""
import msgpack
import pytest
import torch

from roseinfer import LLM
from roseinfer.frontends.redis_streams.client import Client, RequestFailed
from tests.frontends.conftest import pending, raw_chunks, wait_until
from tests.pooling_models import TEXTS, cross_encoder, sentence_model

POOLING = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = sentence_model(tmp_path_factory, "bert", "mean", normalize=True)
    return folder, LLM(folder, **POOLING)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = cross_encoder(tmp_path_factory, "xlm-roberta", labels=1)
    return LLM(folder, **POOLING)


@pytest.fixture
def client(redis_server, prefix):
    with Client(redis_server.url, prefix) as c:
        yield c


def test_embeddings_through_the_worker_equal_the_engines(embedder, client, start_worker):
    _, llm = embedder
    start_worker(llm.engine)
    want = [o.embedding for o in llm.embed(TEXTS)]
    got = client.embed(TEXTS, timeout=30)
    torch.testing.assert_close(torch.tensor(got.embeddings), torch.tensor(want))
    assert got.usage["prompt_tokens"] == sum(o.num_tokens for o in llm.embed(TEXTS))
    one = client.embed("hello world", timeout=30, priority=5)  # through the backlog
    torch.testing.assert_close(torch.tensor(one.embeddings[0]), torch.tensor(want[0]))


def test_float_encoding_and_token_ids(embedder, client, start_worker, real_redis, prefix):
    _, llm = embedder
    start_worker(llm.engine)
    ids = llm.tokenizer(TEXTS[0])["input_ids"]
    real_redis.xadd(f"{prefix}:requests", {"rid": "f1", "body": msgpack.packb(
        {"task": "embed", "input": [ids], "encoding_format": "float"})})
    wait_until(lambda: raw_chunks(real_redis, prefix, "f1"), timeout=30)
    (chunk,) = raw_chunks(real_redis, prefix, "f1")
    assert chunk.finish_reason == "stop" and chunk.pooled["dimensions"] == 32
    torch.testing.assert_close(torch.tensor(chunk.pooled["embeddings"]),
                               torch.tensor([llm.embed([ids])[0].embedding]))


def test_a_rerank_through_a_real_redis_worker(reranker, client, start_worker):
    start_worker(reranker.engine)
    query = "where is the fox"
    got = client.score(query, TEXTS, timeout=30).scores
    want = [o.score for o in reranker.score(query, TEXTS)]
    assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("body, field, code", [
    ({"task": "embed", "input": ["x"] * 100_000}, "input", "too_long"),
    ({"task": "embed", "input": []}, "input", "bad_request"),
    ({"task": "embed", "input": ["abc"], "dimensions": 8}, "dimensions", "bad_request"),
    ({"task": "embed", "input": " ".join(["abc"] * 500)}, "input", "too_long"),
    ({"task": "rerank", "input": ["abc"]}, "task", "bad_request"),
    ({"task": "score", "documents": ["abc"]}, "query", "bad_request"),
    ({"task": "embed", "prompt": "abc"}, "prompt", "bad_request"),
    ({"prompt": "hello"}, "task", "bad_request"),  # generate, on a worker that pools
])
def test_bad_pooling_requests_are_refused_by_name(embedder, start_worker, real_redis, prefix,
                                                  body, field, code):
    _, llm = embedder
    start_worker(llm.engine)
    real_redis.xadd(f"{prefix}:requests", {"rid": "bad", "body": msgpack.packb(body)})
    real_redis.xadd(f"{prefix}:requests", {"rid": "good", "body": msgpack.packb(
        {"task": "embed", "input": "fine"})})
    wait_until(lambda: raw_chunks(real_redis, prefix, "good"), timeout=30)
    wait_until(lambda: raw_chunks(real_redis, prefix, "bad"), timeout=30)
    (error,) = raw_chunks(real_redis, prefix, "bad")
    assert error.finish_reason == "error" and error.error["code"] == code
    assert error.error["message"].startswith(field + ":"), error.error["message"]
    assert raw_chunks(real_redis, prefix, "good")[0].finish_reason == "stop"
    wait_until(lambda: pending(real_redis, prefix) == 0, timeout=10)


def test_a_50_mb_input_is_refused_before_it_is_read(embedder, start_worker, real_redis, prefix):
    _, llm = embedder
    start_worker(llm.engine)
    real_redis.xadd(f"{prefix}:requests", {"rid": "huge", "body": msgpack.packb(
        {"task": "embed", "input": "a " * (25 << 20)})})
    wait_until(lambda: raw_chunks(real_redis, prefix, "huge"), timeout=60)
    (error,) = raw_chunks(real_redis, prefix, "huge")
    assert error.error["code"] == "too_long" and error.error["message"].startswith("body:")


def test_a_generate_worker_refuses_pooling_tasks(tiny_llm, client, start_worker):
    start_worker(tiny_llm.engine)
    with pytest.raises(RequestFailed) as e:
        client.embed(["hello"], timeout=30)
    assert e.value.code == "bad_request" and e.value.message.startswith("task:")
    assert "pools" in e.value.message
