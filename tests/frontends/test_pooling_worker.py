"""Embeddings, scores and classes through a real Redis worker (task embed, score,
classify): the Python client's results equal the engine's own, a rerank goes through, and
bad inputs are refused by name with nothing left pending; a generate worker and a pooling
worker each refuse the other's tasks."""
import base64
import json
import struct

import httpx
import msgpack
import openai
import pytest
import torch

from roseinfer import LLM, SamplingParams
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


def paired(tiny_llm, folder, beside=None, **config):
    from roseinfer.core.config import EngineConfig
    from roseinfer.core.paired_engine import BESIDE_TOKENS, PairedEngine
    from roseinfer.core.pooling_engine import PoolingEngine

    pooler = PoolingEngine(folder, config=EngineConfig(**POOLING, **config))
    return PairedEngine(tiny_llm.engine, pooler, beside or BESIDE_TOKENS)


def test_one_worker_generates_and_embeds(tiny_llm, embedder, client, start_worker,
                                        redis_server, prefix):
    """A generating model with an embedding one beside it (serve --pooling-model): a
    chat's ids equal the generating engine alone's, embeddings the pooling engine's, an
    embedding job at priority 5 (the backlog) sent beside the chat among them."""
    from concurrent.futures import ThreadPoolExecutor

    folder, alone = embedder
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    want_ids = tiny_llm.generate([[5, 6, 7, 8]], SamplingParams(**greedy))[0].token_ids
    want = torch.tensor([o.embedding for o in alone.embed(TEXTS)])
    start_worker(paired(tiny_llm, folder))
    with Client(redis_server.url, prefix) as other, ThreadPoolExecutor(1) as pool:
        job = pool.submit(other.embed, TEXTS * 8, timeout=60, priority=5)
        assert client.generate([5, 6, 7, 8], timeout=30, **greedy).token_ids == want_ids
        got = torch.tensor(client.embed(TEXTS, timeout=30).embeddings)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.tensor(job.result().embeddings), want.repeat(8, 1))


def test_the_pooling_batches_yield_to_generation(tiny_llm, embedder, monkeypatch):
    """Embeddings alone take whole batches; beside a decoding chat, batches of at most
    the beside budget; in a step where a chat's prompt waits, none; every result exact."""
    from roseinfer.core.pooling_task import PoolingTask

    folder, alone = embedder
    pair, budgets, waiting = paired(tiny_llm, folder, 8, max_num_batched_tokens=64), [], []
    step = pair.pooler.step
    monkeypatch.setattr(pair.pooler, "step", lambda n=None: budgets.append(n) or step(n))
    texts = TEXTS * 10  # whole batches of 128 tokens: more than one
    for i in range(len(texts)):
        pair.add_request(f"e{i}", pair.prepare(PoolingTask("embed", [texts[i]])))
    outs = {o.request_id: o for o in pair.step()}
    assert budgets == [None]  # nothing generates: a whole batch
    pair.add_request("chat", [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0,
                                                          ignore_eos=True))
    while pair.has_unfinished():
        waiting.append(bool(tiny_llm.engine.scheduler.waiting))
        before = len(budgets)
        outs.update({o.request_id: o for o in pair.step() if o.finished})
        if waiting[-1]:
            assert len(budgets) == before  # the chat's prompt waited: no pooling batch
    assert 8 in budgets and set(budgets) <= {None, 8}
    want = [o.embedding for o in alone.embed(texts)]
    for i, vector in enumerate(want):
        torch.testing.assert_close(torch.tensor(outs[f"e{i}"].result), torch.tensor([vector]))
    assert outs["chat"].token_ids == tiny_llm.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids


# --- the gateway ---------------------------------------------------------------------------

def api(g):
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0)


def test_openai_embeddings_equal_the_engines(embedder, start_worker, gateway):
    """The official client's embeddings.create, float and base64 (its default), and
    LangChain's OpenAIEmbeddings, against LLM.embed."""
    _, llm = embedder
    start_worker(llm.engine)
    g = gateway()
    want = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
    for encoding in ("float", "base64", None):  # None: the client asks base64, decodes it
        reply = api(g).embeddings.create(model="tiny", input=TEXTS,
                                         **({"encoding_format": encoding} if encoding else {}))
        rows = [d.embedding for d in reply.data]
        if encoding == "base64":  # asked for: the client hands the text over as it came
            rows = [struct.unpack(f"<{len(b) // 4}f", b) for b in map(base64.b64decode, rows)]
        torch.testing.assert_close(torch.tensor(rows), want)
        assert [d.index for d in reply.data] == list(range(len(TEXTS)))
        assert reply.usage.prompt_tokens == sum(o.num_tokens for o in llm.embed(TEXTS))
    one = api(g).embeddings.create(model="tiny", input="hello world").data[0].embedding
    torch.testing.assert_close(torch.tensor(one), want[0])
    from langchain_openai import OpenAIEmbeddings
    lc = OpenAIEmbeddings(model="tiny", base_url=f"{g.url}/v1", api_key="none",
                          check_embedding_ctx_length=False)
    torch.testing.assert_close(torch.tensor(lc.embed_documents(TEXTS)), want)
    models = api(g).models.list().data
    assert models[0].tasks == ["embed", "score"]
    assert 'endpoint="/v1/embeddings"' in httpx.get(g.url + "/metrics").text  # counted


def test_openai_embeddings_refuse_bad_input_by_name(embedder, start_worker, gateway):
    _, llm = embedder
    start_worker(llm.engine)
    g = gateway()
    for kwargs, param in [(dict(input="abc", dimensions=8), "dimensions"),
                          (dict(input=[]), "input"),
                          (dict(input=" ".join(["abc"] * 500)), "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            api(g).embeddings.create(model="tiny", **kwargs)
        assert e.value.body["param"] == param, e.value.body


def test_rerank_score_and_classify_routes(reranker, start_worker, gateway, tmp_path_factory):
    start_worker(reranker.engine)
    g = gateway()
    query, docs = "where is the fox", TEXTS[:4]
    want = [o.score for o in reranker.score(query, docs)]
    for path in ("/v1/rerank", "/rerank"):
        reply = httpx.post(g.url + path, json={"model": "tiny", "query": query, "top_n": 3,
                                               "documents": [{"text": d} for d in docs]}).json()
        ranked = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
        assert [r["index"] for r in reply["results"]] == ranked
        assert [r["document"]["text"] for r in reply["results"]] == [docs[i] for i in ranked]
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx(
            [want[i] for i in ranked], abs=1e-6)
    scored = httpx.post(g.url + "/v1/score", json={"model": "tiny", "text_1": query,
                                                   "text_2": docs}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-6)
    classes = httpx.post(g.url + "/classify", json={"model": "tiny", "input": docs}).json()
    torch.testing.assert_close(torch.tensor([d["probs"] for d in classes["data"]]),
                               torch.tensor([o.probs for o in reranker.classify(docs)]))
    assert classes["data"][0]["label"] == "LABEL_0" and classes["data"][0]["num_classes"] == 1
    missing = httpx.post(g.url + "/v1/rerank", json={"model": "tiny", "documents": docs})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "query"


# --- roseinfer embed ----------------------------------------------------------------------

def test_the_embed_command_writes_every_input_once_and_resumes(embedder, start_worker,
                                                              redis_server, prefix, tmp_path):
    """A file of 40 texts, one of them over the model's length: each good one's embedding
    equals LLM.embed's, the long one is an error line. Cut after 17 results (the last line
    half written, as a kill leaves it), a second run adds only the missing ones."""
    from roseinfer.cli import main
    _, llm = embedder
    start_worker(llm.engine)
    texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(40)]
    texts[13] = " ".join(["abc"] * 500)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n"
                              for i, t in enumerate(texts)))
    argv = ["embed", str(source), "--out", str(out), "--redis-url", redis_server.url,
            "--prefix", prefix, "--batch", "6", "--in-flight", "3", "--no-progress"]
    assert main(argv) == 1  # one input refused

    def records():
        return [json.loads(line) for line in out.read_text().splitlines()]
    first = records()
    assert [r["id"] for r in first if "error" in r] == ["doc-13"]
    assert next(r for r in first if "error" in r)["error"]["code"] == "too_long"
    good = {f"doc-{i}": t for i, t in enumerate(texts) if i != 13}
    want = dict(zip(good, (o.embedding for o in llm.embed(list(good.values())))))
    assert {r["id"] for r in first if "embedding" in r} == set(good)
    for r in first:
        if "embedding" in r:
            torch.testing.assert_close(torch.tensor(r["embedding"]), torch.tensor(want[r["id"]]))

    kept = out.read_text().splitlines(keepends=True)[:17]
    out.write_text("".join(kept) + kept[-1][:25])  # killed mid-line
    assert main(argv) == 1
    again = records()
    embedded = [r["id"] for r in again if "embedding" in r]
    assert sorted(embedded) == sorted(good)  # each once: the first 17 were not redone
