"""The benchmark harness: metric definitions by hand, workloads, and `roseinfer bench`
end to end on a tiny model (offline, against transformers, and through a real Redis)."""
import importlib.util
import json

import pytest
import torch

from roseinfer.bench.metrics import RequestRecord, distribution, run_metrics, summarize
from roseinfer.bench.workloads import (
    Workload, build_prompts, parse_repeats, random_prompts, sampling_of)
from roseinfer.cli import main

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                "--no-cuda-graphs", "--no-progress"]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
WORKLOAD = ["--num-requests", "5", "--prompt", "Hello", "--prompt-repeats", "1,4",
            "--max-new-tokens", "6", "--ignore-eos", "--warmup-runs", "1", "--repeat-runs", "2"]


# --- metrics, against values worked out by hand ---------------------------------------

def _record(rid="a", submit=0.0, chunks=((0.1, 1), (0.15, 1), (0.25, 1)), **kw):
    return RequestRecord(rid, submit=submit, prompt_tokens=kw.pop("prompt_tokens", 4),
                         chunks=list(chunks), finish_reason=kw.pop("finish_reason", "length"), **kw)


def test_per_request_metrics_follow_the_vllm_definitions():
    r = _record(submit=1.0, chunks=[(1.1, 1), (1.15, 1), (1.25, 1)], first_scheduled=1.02)
    assert r.output_tokens == 3
    assert r.ttft == pytest.approx(0.1)
    assert r.latency == pytest.approx(0.25)
    assert r.tpot == pytest.approx((0.25 - 0.1) / 2)
    assert r.itls == pytest.approx([0.05, 0.1])
    assert r.queue_wait == pytest.approx(0.02)


def test_chunked_stream_counts_tokens_not_chunks():
    # stream interval 4: chunks of 1, 4 and 3 tokens; TPOT divides by tokens - 1 = 7
    r = _record(chunks=[(0.2, 1), (0.6, 4), (0.9, 3)])
    assert r.output_tokens == 8
    assert r.tpot == pytest.approx((0.9 - 0.2) / 7)
    assert r.itls == pytest.approx([0.4, 0.3])


def test_single_token_request_has_no_tpot_and_unobserved_queue_wait_is_none():
    r = _record(chunks=[(0.3, 1)])
    assert r.tpot is None and r.itls == [] and r.queue_wait is None


def test_distribution_uses_linear_percentiles_in_ms():
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d == pytest.approx({"mean": 2500.0, "p50": 2500.0, "p95": 3850.0, "p99": 3970.0})
    assert distribution([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_run_metrics_throughput_counts_completed_requests_only():
    ok = _record("a", prompt_tokens=4)                                # 3 tokens
    ok2 = _record("b", chunks=[(0.5, 1), (1.0, 1)], prompt_tokens=1)  # 2 tokens
    failed = _record("c", chunks=[(0.2, 1)], finish_reason="error", error="internal: boom")
    m = run_metrics([ok, ok2, failed], duration_s=2.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (3, 2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (5, 5)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(5.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(300.0)      # TTFTs 0.1 and 0.5 s
    assert m["tpot_ms"]["mean"] == pytest.approx((75.0 + 500.0) / 2)
    assert m["queue_wait_ms"]["p50"] is None


def test_summarize_means_numbers_over_runs():
    runs = [{"output_throughput": 10.0, "ttft_ms": {"p50": 1.0, "p99": None}, "requests": [1],
             "compiled": True},
            {"output_throughput": 20.0, "ttft_ms": {"p50": 3.0, "p99": 5.0}, "requests": [2],
             "compiled": True}]
    s = summarize(runs)
    assert s["compiled"] is True
    assert s["output_throughput"] == 15.0
    assert (s["output_throughput_min"], s["output_throughput_max"]) == (10.0, 20.0)
    assert s["ttft_ms"] == {"p50": 2.0, "p99": None}
    assert "requests" not in s and s["num_runs"] == 2


# --- workloads -------------------------------------------------------------------------

def test_prompt_repeats_cycle_over_requests(gpt2_tok):
    prompts, ids = build_prompts(5, "Hello", [1, 4], gpt2_tok, 50257)
    assert prompts == ["Hello", "Hello Hello Hello Hello"] * 2 + ["Hello"]
    assert [len(p) for p in ids] == [1, 4, 1, 4, 1]


def test_pretokenized_prompts_repeat_the_unit_ids(gpt2_tok):
    hello = gpt2_tok.encode("Hello")
    prompts, ids = build_prompts(3, "Hello", [1, 4], gpt2_tok, 50257, pretok=True)
    assert prompts == ids == [hello, hello * 4, hello]


def test_without_a_tokenizer_prompts_are_a_fixed_token():
    prompts, _ = build_prompts(2, "Hello", [2, 3], None, 49152)
    assert prompts == [[1000, 1000], [1000, 1000, 1000]]
    prompts, _ = build_prompts(1, "Hello", [2], None, 49152, fixed_token=7)
    assert prompts == [[7, 7]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_prompts(1, "Hello", [1], None, 100, fixed_token=100)


def test_a_failing_variant_raises_unavailable_but_dynamic_failures_propagate():
    from roseinfer.bench.hf_baseline import VariantUnavailable, run_hf
    from roseinfer.bench.workloads import Workload

    class Broken:
        device = torch.device("cpu")

        def generate(self, *args, **kwargs):
            raise RuntimeError("inductor: no C++ compiler\nlong trace")

    w = Workload([[1]], [[1]], 2, True)
    with pytest.raises(VariantUnavailable, match="RuntimeError: inductor: no C"):
        run_hf(Broken(), None, w, "static")
    with pytest.raises(RuntimeError):
        run_hf(Broken(), None, w, "dynamic")


@pytest.mark.parametrize("bad", ["", "0,1", "a"])
def test_bad_prompt_repeats_are_refused(bad):
    with pytest.raises(ValueError, match="prompt-repeats"):
        parse_repeats(bad)


# --- end to end on a tiny model --------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_tok(tmp_path_factory):
    from roseinfer.models.tokenizers import gpt2_tokenizer
    return gpt2_tokenizer(str(tmp_path_factory.mktemp("tok-cache")))


def _save_tiny_gpt2(path, tokenizer=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, gpt2_tok):
    return _save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), gpt2_tok)


def _bench(tmp_path, mode, model, *extra):
    out = tmp_path / f"{mode}.json"
    code = main(["bench", mode, "--model", model, *ENGINE_FLAGS, *WORKLOAD,
                 "--output-json", str(out), *extra])
    return code, json.loads(out.read_text())


def _assert_all_requests_complete(result, max_new=6, prompt_tokens=(1, 4, 1, 4, 1)):
    runs = result["roseinfer"]["runs"]
    assert len(runs) == 2
    for run in runs:
        assert run["completed"] == run["num_requests"] == 5
        assert [r["output_tokens"] for r in run["requests"]] == [max_new] * 5
        assert [r["prompt_tokens"] for r in run["requests"]] == list(prompt_tokens)
        assert {r["finish_reason"] for r in run["requests"]} == {"length"}
        assert run["total_output_tokens"] == 5 * max_new
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_latency_ms"]["p50"]
        assert run["output_throughput"] == pytest.approx(5 * max_new / run["duration_s"])
    s = result["roseinfer"]["summary"]
    assert s["num_runs"] == 2 and s["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms", "queue_wait_ms"):
        assert set(s[key]) == {"mean", "p50", "p95", "p99"}, key
        assert s[key]["p50"] is not None and s[key]["p50"] >= 0, key


def test_bench_offline_against_transformers(tmp_path, tiny_dir, capsys, monkeypatch):
    from roseinfer.bench import hf_baseline

    real_run_hf = hf_baseline.run_hf

    def run_hf(model, tokenizer, w, variant):  # compiling takes ~25 s here: fail it instead
        if variant == "static":
            raise hf_baseline.VariantUnavailable("no compiler in this test")
        return real_run_hf(model, tokenizer, w, variant)

    monkeypatch.setattr(hf_baseline, "run_hf", run_hf)
    chart = tmp_path / "chart.png"
    plot = ["--plot", str(chart)] if HAVE_MATPLOTLIB else []  # the `bench` extra
    code, result = _bench(tmp_path, "offline", tiny_dir, "--compare-hf",
                          "--hf-variants", "dynamic,static", *plot)
    assert code == 0
    _assert_all_requests_complete(result)
    assert result["workload"]["prompt_tokens_total"] == 11
    assert result["meta"]["mode"] == "offline" and result["meta"]["cpu_count"] >= 1
    hf = result["hf"]["dynamic"]
    assert len(hf["runs"]) == 2 and hf["summary"]["total_output_tokens"] == 30
    # float32 greedy on the same weights: transformers is the independent reference.
    assert hf["summary"]["outputs_equal_to_roseinfer"] == 1.0
    assert result["ratios"]["dynamic"] == pytest.approx(
        result["roseinfer"]["summary"]["output_throughput"] / hf["summary"]["output_throughput"])
    assert result["hf"]["static"] == {"skipped": "no compiler in this test"}
    assert set(result["ratios"]) == {"dynamic"}
    printed = capsys.readouterr().out
    assert "roseinfer / transformers dynamic" in printed and "static: skipped" in printed
    if not HAVE_MATPLOTLIB:
        return
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    combined = tmp_path / "combined.png"
    assert main(["bench", "plot", str(tmp_path / "offline.json"), "--output", str(combined)]) == 0
    assert combined.stat().st_size > 0


def test_bench_offline_with_pretokenized_prompts(tmp_path, tiny_dir):
    code, result = _bench(tmp_path, "offline", tiny_dir, "--pretok", "--prompt-token-id", "42")
    assert code == 0
    _assert_all_requests_complete(result)
    assert result["workload"]["pretokenized"] is True


@pytest.mark.parametrize("schedule", ["absolute", "relative"])
def test_offline_schedule_spaces_submits(tiny_dir, schedule):
    from roseinfer import LLM
    from roseinfer.bench.offline import run_offline
    from roseinfer.bench.probe import EngineProbe
    from roseinfer.bench.progress import Progress
    from roseinfer.bench.workloads import Workload

    llm = LLM(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    ids = [[15496]] * 4
    w = Workload(ids, ids, 4, True, submit_interval_s=0.03, schedule=schedule)
    metrics, records = run_offline(EngineProbe(llm.engine), w, "s", Progress(16, "", False))
    assert metrics["completed"] == 4
    for prev, rec in zip(records, records[1:]):
        assert rec.submit >= rec.due
        base = prev.submit if schedule == "relative" else prev.due
        assert rec.due == pytest.approx(base + 0.03)
        assert rec.first_scheduled >= rec.submit


def test_bench_serve_through_real_redis(tmp_path, tiny_dir):
    code, result = _bench(tmp_path, "serve", tiny_dir, "--submit-interval-ms", "10",
                          "--stream-interval", "4")
    assert code == 0
    _assert_all_requests_complete(result)
    assert result["meta"]["mode"] == "serve"
    assert result["workload"]["stream_interval"] == 4


def test_bench_serve_sends_each_request_a_fresh_image(tmp_path):
    """--images: each request a chat with its own picture before its text, through the
    queue to a vision-language model (tiny Qwen2.5-VL, with the synthetic tokenizer that
    gives a random shape one): every request completes, its prompt widened by the image's
    tokens (a 56 x 56 picture: 4); prompts as token ids are refused by name."""
    import sys
    from pathlib import Path

    from tests.vision_models import tiny_qwen2_5_vl

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "bench"))
    from synthetic_tokenizer import build

    model = tmp_path / "vl"
    hf = tiny_qwen2_5_vl()
    hf.save_pretrained(model)
    build(hf.config.text_config.vocab_size, hf.config.image_token_id).save_pretrained(model)
    code, result = _bench(tmp_path, "serve", str(model), "--images", "56")
    assert code == 0
    # <|im_start|> user <|vision_start|> 4 image tokens <|vision_end|> Hello (x 1 or 4)
    # <|im_end|> <|im_start|> assistant: 8 tokens and the text's, 4 of the image
    _assert_all_requests_complete(result, prompt_tokens=[8 + n + 4 for n in (0, 3, 0, 3, 0)])
    with pytest.raises(SystemExit, match="text prompts"):
        _bench(tmp_path, "serve", str(model), "--images", "56", "--pretok")


def test_bench_serve_through_the_openai_gateway(tmp_path, tiny_dir):
    """--endpoint openai: the same requests through the gateway, each chunk's tokens
    counted from the usage every chunk carries."""
    code, result = _bench(tmp_path, "serve", tiny_dir, "--endpoint", "openai",
                          "--client-procs", "2")
    assert code == 0
    _assert_all_requests_complete(result)
    assert result["meta"]["endpoint"] == "openai"


def test_random_dataset_follows_vllms_lengths_and_shares_no_prefix():
    prompts = random_prompts(200, input_len=10, range_ratio=0.3, vocab_size=50, seed=1)
    assert {len(p) for p in prompts} == set(range(7, 14))
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert len({tuple(p[:3]) for p in prompts}) > 150
    assert random_prompts(3, 4, 0.0, 50, seed=1) == random_prompts(3, 4, 0.0, 50, seed=1)
    with pytest.raises(ValueError, match="--range-ratio"):
        random_prompts(3, 4, 1.0, 50)


def test_sampling_flags_reach_the_engine_and_greedy_sends_none():
    from roseinfer.bench.offline import sampling_params

    assert sampling_of(0.0, 0.9, 5) == {}
    w = Workload([[1]], [[1]], 4, True, sampling=sampling_of(0.7, 0.9, 20))
    p, = sampling_params(w)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.9, 20, 4)
    assert sampling_params(Workload([[1]], [[1]], 4, True))[0].temperature == 0.0


def test_random_dataset_varies_output_lengths_too(tmp_path, tiny_dir):
    """vLLM's meaning and names: --range-ratio spreads --output-len as it spreads
    --input-len, and each request makes exactly its own count (ignore_eos). (The other
    tests use --max-new-tokens, its alias.)"""
    code, result = _bench(tmp_path, "offline", tiny_dir, "--dataset", "random", "--input-len",
                          "6", "--output-len", "10", "--range-ratio", "0.5",
                          "--num-requests", "12")
    assert code == 0
    w = result["workload"]
    assert 5 <= w["output_tokens_min"] < w["output_tokens_max"] <= 15
    for run in result["roseinfer"]["runs"]:
        assert run["completed"] == 12
        assert run["total_output_tokens"] == w["output_tokens_total"]


def test_bench_serve_drives_a_fleet_it_did_not_start(tmp_path, tiny_dir):
    import threading

    import redis

    from roseinfer import LLM
    from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
    from roseinfer.frontends.redis_streams.worker import Worker

    with EmbeddedRedis(port=free_port()) as server:
        llm = LLM(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=64, cuda_graphs=False)
        worker = Worker(llm.engine, redis.Redis.from_url(server.url), prefix="fleet",
                        block_ms=50, chat_template=False)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            code, result = _bench(tmp_path, "serve", tiny_dir, "--no-worker", "--redis-url",
                                  server.url, "--prefix", "fleet")
        finally:
            worker.stop(0)
            thread.join(10)
    assert code == 0
    for run in result["roseinfer"]["runs"]:
        assert run["completed"] == run["num_requests"] == 5
        assert [r["output_tokens"] for r in run["requests"]] == [6] * 5
        assert run["ttft_ms"]["p50"] > 0 and "engine_steps" not in run
        assert run["queue_wait_ms"]["p50"] is None  # the fleet's engine is not visible here
    assert worker._totals["finished"] == 3 * 5  # warm-up and two runs, all served there


def test_request_rate_gives_poisson_arrivals_and_inf_a_burst():
    w = Workload([[1]] * 4000, [[1]] * 4000, 4, True, request_rate=50.0, seed=3)
    gaps = [b - a for a, b in zip(w.offsets, w.offsets[1:])]
    assert w.offsets[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential, mean 1/rate
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.02 * 0.693, rel=0.1)  # its median
    assert w.offsets == Workload([[1]] * 4000, [[1]] * 4000, 4, True, request_rate=50.0,
                                 seed=3).offsets
    assert Workload([[1]] * 3, [[1]] * 3, 4, True, request_rate=float("inf")).offsets == [0.0] * 3
    assert Workload([[1]] * 3, [[1]] * 3, 4, True, submit_interval_s=0.5).offsets == [0, 0.5, 1.0]
    with pytest.raises(ValueError, match="--request-rate"):
        Workload([[1]], [[1]], 4, True, request_rate=0.0)


def test_offline_submits_on_the_poisson_schedule(tmp_path, tiny_dir):
    code, result = _bench(tmp_path, "offline", tiny_dir, "--request-rate", "20")
    assert code == 0 and result["workload"]["request_rate"] == 20.0
    for run in result["roseinfer"]["runs"]:
        assert run["completed"] == 5


@pytest.mark.parametrize("kernels", [("plain", "plain"), ("packed", "packed"),
                                     ("plain", "packed")])
def test_decode_bytes_floor_counts_weights_per_step_and_kv_per_token(gpt2_model, monkeypatch,
                                                                     kernels):
    """Whichever kernels the CPU linears' timings pick (the user's cached timings once
    changed the count), a step reads each weight once."""
    from roseinfer import LLM
    from roseinfer.bench.floor import decode_floor, kv_bytes_per_token, weight_bytes
    from roseinfer.layers import cpu_linear

    monkeypatch.setattr(cpu_linear, "_choose", lambda times: kernels)
    eng = LLM(gpt2_model, device="cpu", dtype="float32", num_kv_blocks=64,
              max_num_seqs=2).engine
    cfg = gpt2_model.config
    params = sum(p.numel() for p in gpt2_model.parameters())  # wte counted once (tied)
    # A step reads every weight but the position table; the tied head reads all of wte.
    assert weight_bytes(eng.model) == 4 * (params - cfg.n_positions * cfg.n_embd)
    kv_tok = kv_bytes_per_token(eng.kv_cache)
    assert kv_tok == 2 * cfg.n_layer * cfg.n_embd * 4
    f = decode_floor(eng, [3, 5, 1], [2, 4, 4], peak=1e9)
    # 10 tokens, 2 per step: 5 steps; K/V read: (3 + 4) + (5+6+7+8) + (1+2+3+4) tokens.
    assert f["decode_steps"] == 5
    want = (5 * weight_bytes(eng.model) + 43 * kv_tok) / 1e9
    assert f["seconds"] == pytest.approx(want) and f["output_throughput"] == pytest.approx(10 / want)


def test_the_floor_of_a_mixture_of_experts_counts_the_experts_a_step_chooses(monkeypatch):
    """Qwen3-MoE's tiny config: 8 experts, top 2, in its first layer (its second dense).
    One token reads its 2 experts; 64 tokens read, expected, 8 (1 - (6/8)^64) of them."""
    from roseinfer import LLM
    from roseinfer.bench.floor import decode_floor, weight_bytes
    from roseinfer.layers import cpu_linear
    from tests.models import tiny_family

    # The dense linears as the checkpoint holds them: oneDNN's packed layout pads this
    # config's 72-wide weights, and which layout the timings pick varies by machine.
    monkeypatch.setattr(cpu_linear, "_choose", lambda times: ("plain", "plain"))
    hf = tiny_family("qwen3_moe")
    eng = LLM(hf, device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=64).engine
    moe = eng.model.layers[0].moe
    expert = 4 * (moe.w13[0].numel() + moe.w2[0].numel())
    dense = sum(p.numel() for n, p in hf.named_parameters()
                if "experts" not in n and "embed_tokens" not in n)
    assert weight_bytes(eng.model) == 4 * dense  # the router, not the experts
    one = decode_floor(eng, [4], [3], peak=1e9)
    assert one["expert_bytes_per_step"] == pytest.approx(2 * expert)
    batch = decode_floor(eng, [4] * 64, [3] * 64, peak=1e9)
    assert batch["expert_bytes_per_step"] == pytest.approx(8 * (1 - 0.75 ** 64) * expert)
    assert batch["seconds"] == pytest.approx(
        (3 * (4 * dense + batch["expert_bytes_per_step"]) + 64 * (3 * 4 + 3) *
         batch["kv_bytes_per_token"]) / 1e9)


def test_the_floor_counts_a_window_layers_window_of_keys():
    """Gemma 3's tiny config: layer 0 attends over a 4-token window, layer 1 over all.
    Decoding 6 tokens after 10 reads 6 x 4 keys in layer 0, 10 + 11 + ... + 15 in 1."""
    from roseinfer import LLM
    from roseinfer.bench.floor import decode_floor, keys_read
    from tests.models import tiny_family

    assert keys_read(3, 5, 4) == 3 + 4 + 4 + 4 + 4 and keys_read(3, 5) == 3 + 4 + 5 + 6 + 7
    assert keys_read(9, 2, 4) == 8 and keys_read(1, 3, 4) == 1 + 2 + 3
    eng = LLM(tiny_family("gemma3_text"), device="cpu", dtype="float32",
              num_kv_blocks=64).engine
    layer = 2 * 2 * 12 * 4  # K and V, 2 heads of 12 float32s
    f = decode_floor(eng, [10], [6], peak=1e9)
    assert f["seconds"] == pytest.approx((6 * f["weight_bytes"] + (24 + 75) * layer) / 1e9)


def test_max_concurrency_caps_requests_in_flight(monkeypatch):
    """A due request waits for a slot; each client process gets its share of the cap."""
    import asyncio
    import types

    from roseinfer.bench import serve
    from roseinfer.frontends.redis_streams import client as client_mod

    assert [serve._share(5, k, 2) for k in range(2)] == [3, 2]
    assert [serve._share(1, k, 3) for k in range(3)] == [1, 1, 1]
    assert serve._share(None, 0, 2) is None
    live, peak = 0, 0

    class FakeClient:
        def __init__(self, *a):
            pass

        async def submit(self, prompt, rid, **params):
            nonlocal live, peak
            live += 1
            peak = max(peak, live)

        async def stream(self, rid, timeout):
            nonlocal live
            await asyncio.sleep(0.01)
            live -= 1
            yield types.SimpleNamespace(token_ids=[1], finished=True, finish_reason="length",
                                        usage={}, error=None)

        async def close(self):
            pass

    monkeypatch.setattr(client_mod, "AsyncClient", FakeClient)
    spec = {"url": "", "prefix": "", "run_id": "r", "t0": serve.now(), "prompts": [[1]] * 12,
            "params": {}, "output_lens": [1] * 12, "interval_s": 0.0, "offsets": [0.0] * 12,
            "schedule": "absolute", "shard": 0, "num_shards": 1, "timeout_s": 5.0,
            "max_concurrency": 3}
    rows = serve.client_run(spec)
    assert len(rows) == 12 and all(r["finish_reason"] == "length" for r in rows)
    assert peak == 3


def test_bench_serve_chat_with_tools_through_the_gateway(tmp_path, tiny_dir):
    """--endpoint openai-chat --tools-file: each text prompt a user turn offering the
    tools (tool_choice auto), through the gateway; what tools cost is measured this way
    (docs/gateway.md)."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% if tools %}{{ tools | length }} tools\n{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tok.save_pretrained(model)
    tools = tmp_path / "tools.json"
    offered = [{"type": "function", "function": {"name": "f"}}]
    tools.write_text(json.dumps(offered))
    for extra, given in (([], None), (["--tools-file", str(tools)], offered)):
        code, result = _bench(tmp_path, "serve", str(model), "--endpoint", "openai-chat",
                              *extra)
        assert code == 0
        # each prompt as its template renders it: with the tools, a line more
        lengths = [len(tok.encode(tok.apply_chat_template([{"role": "user", "content": " ".join(
            ["Hello"] * n)}], tools=given, tokenize=False))) for n in (1, 4, 1, 4, 1)]
        _assert_all_requests_complete(result, prompt_tokens=lengths)
    with pytest.raises(SystemExit, match="openai-chat"):
        _bench(tmp_path, "serve", str(model), "--tools-file", str(tools))
