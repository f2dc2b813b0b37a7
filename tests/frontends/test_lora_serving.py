"""LoRA adapters through a real Redis worker: requests for four adapters and the base
model interleaved, each stream exact; adapters loaded and unloaded while the worker
runs (P:adapters, `roseinfer lora`'s path); the gateway's model names an adapter,
/v1/models lists them, and vLLM's load and unload endpoints work."""
import subprocess

import openai
import pytest
import redis

from roseinfer import LLM, SamplingParams
from roseinfer.frontends.redis_streams import adapters
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Keys
from tests.models import tiny_llama
from tests.test_greedy_equality import mixed_prompts
from tests.test_lora import make_adapter

from .conftest import raw_chunks, roseinfer_cmd, wait_until

pytest.importorskip("peft")
NAMES = ["a0", "a1", "a2", "a3"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(LLM with enable_lora and two slots, {name: path}, {name or None: expected ids per
    prompt}), four adapters loaded."""
    base = tiny_llama()
    paths = {n: str(tmp_path_factory.mktemp(n)) for n in NAMES}
    llm = LLM(base, device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_seqs=8, enable_lora=True, max_loras=2)
    for i, (name, path) in enumerate(paths.items()):
        make_adapter(base, path, seed=10 + i)
    prompts = mixed_prompts(5, seed=11)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = {}
    for name in [*NAMES, None]:
        if name:
            llm.add_lora(name, paths[name])
        want[name] = [o.token_ids for o in llm.generate(prompts, greedy, lora=name)]
    for name in NAMES:
        llm.remove_lora(name)
    return llm, paths, prompts, want


def test_four_adapters_interleaved_through_redis(served, redis_server, start_worker, prefix):
    llm, paths, prompts, want = served
    r, keys = redis.Redis.from_url(redis_server.url), Keys(prefix)
    for name in NAMES[:2]:  # loaded before the worker starts: it reads them at start
        r.xadd(keys.adapters, adapters.entry("load", name, paths[name]))
    start_worker(llm.engine, heartbeat_s=0.2)
    for name in NAMES[2:]:  # and while it runs
        assert list(adapters.request(r, keys, "load", name, paths[name]).values()) == ["ok"]
    failed = adapters.request(r, keys, "load", "broken", "/nowhere")
    assert "no adapter_config.json" in next(iter(failed.values()))
    client = Client(redis_server.url, prefix)
    order = [(n, i) for i in range(len(prompts)) for n in [*NAMES, None]]
    rids = {(n, i): client.submit(prompts[i], max_tokens=8, temperature=0, ignore_eos=True,
                                  lora=n) for n, i in order}
    for (n, i), rid in rids.items():
        ids = [t for c in client.stream(rid, timeout=60) for t in c.token_ids]
        assert ids == want[n][i], (n, i)
    assert llm.engine.lora_names == NAMES
    assert llm.engine.loras.num_swaps > 2  # four adapters through two slots
    bad = client.submit(prompts[0], max_tokens=2, lora="nope")
    (chunk,) = list(client.stream(bad, timeout=30))
    assert chunk.error["code"] == "bad_request"
    assert "unknown adapter 'nope'" in chunk.error["message"]
    for name in NAMES:
        assert list(adapters.request(r, keys, "unload", name).values()) == ["ok"]
    assert llm.engine.lora_names == []


def test_the_gateway_names_adapters_by_model(served, start_worker, gateway, redis_server,
                                             prefix):
    llm, paths, prompts, want = served
    start_worker(llm.engine, heartbeat_s=0.2)
    g = gateway()
    http = openai.OpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0)
    loaded = http.post("/load_lora_adapter", cast_to=str,
                       body={"lora_name": "a1", "lora_path": paths["a1"]})
    assert "a1" in loaded
    assert [m.id for m in http.models.list().data] == ["tiny", "a1"]
    for model, name in (("a1", "a1"), ("tiny", None)):
        done = http.completions.create(model=model, prompt=prompts[1], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True},
                                       extra_headers={"x-request-id": f"g-{model}"})
        assert done.model == model
        # a model without a tokenizer answers ids only: read them off the reply stream
        chunks = raw_chunks(redis.Redis.from_url(redis_server.url), prefix, f"g-{model}")
        assert [t for c in chunks for t in c.token_ids] == want[name][1]
    # a name no worker serves is the base model, as any model name was before adapters
    http.completions.create(model="a2", prompt=prompts[1], max_tokens=8, temperature=0,
                            extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "g-a2"})
    chunks = raw_chunks(redis.Redis.from_url(redis_server.url), prefix, "g-a2")
    assert [t for c in chunks for t in c.token_ids] == want[None][1]
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        http.post("/load_lora_adapter", cast_to=str,
                  body={"lora_name": "x", "lora_path": "/nowhere"})
    http.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "a1"})
    assert [m.id for m in http.models.list().data] == ["tiny"]


def test_status_and_metrics_show_the_adapters(served, redis_server, start_worker, prefix):
    llm, paths, prompts, want = served
    from roseinfer.frontends.redis_streams import status
    from roseinfer.frontends.redis_streams.metrics import Metrics

    r, keys = redis.Redis.from_url(redis_server.url), Keys(prefix)
    metrics = Metrics("tiny")
    worker = start_worker(llm.engine, heartbeat_s=0.2, metrics=metrics)
    lora = ("lora", "--redis-url", redis_server.url, "--prefix", prefix)
    done = subprocess.run(roseinfer_cmd(*lora, "load", "a0", paths["a0"]), capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, f"{worker.worker.consumer}: ok\n")
    failed = subprocess.run(roseinfer_cmd(*lora, "load", "broken", "/nowhere"),
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "no adapter_config.json" in failed.stdout
    client = Client(redis_server.url, prefix)
    rid = client.submit(prompts[0], max_tokens=8, temperature=0, ignore_eos=True, lora="a0")
    assert [t for c in client.stream(rid, timeout=60) for t in c.token_ids] == want["a0"][0]
    text = status.render(status.collect(r, keys, "workers"))
    assert "LoRA adapters: a0; broken failed: adapter 'broken'" in text
    wait_until(lambda: metrics.registry.get_sample_value(
        "roseinfer:lora_adapters", {"model_name": "tiny"}) == 1)
    assert metrics.registry.get_sample_value("roseinfer:lora_swaps_total",
                                             {"model_name": "tiny"}) >= 1
    adapters.request(r, keys, "unload", "a0")
