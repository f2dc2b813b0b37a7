"""The Node.js example client (examples/node) against a real Redis and a worker."""
import json
import os
import re
import shutil
import subprocess

import pytest

from roseinfer import SamplingParams

from .conftest import CODE

NODE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "node")

pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not on PATH"),
    pytest.mark.skipif(not os.path.isdir(os.path.join(NODE_DIR, "node_modules")),
                       reason="examples/node/node_modules is missing: run `npm ci --prefix examples/node`"),
]


def node_client(redis_server, prefix, *args):
    return subprocess.run(["node", "client.mjs", *args, "--redis-url", redis_server.url, "--prefix", prefix],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=60)


def test_node_client_streams_the_greedy_text(tiny_llm, start_worker, redis_server, prefix):
    worker = start_worker(tiny_llm.engine)
    done = node_client(redis_server, prefix, "The capital of France is", "--max-tokens", "12",
                       "--temperature", "0")
    refused = node_client(redis_server, prefix, "word " * 300)
    scored = node_client(redis_server, prefix, "The capital of France is", "--max-tokens", "6",
                         "--logprobs", "2", "--repetition-penalty", "1.3", "--logit-bias", "13:2")
    prompt_scored = node_client(redis_server, prefix, "The capital of France is",
                                "--max-tokens", "2", "--prompt-logprobs", "1")
    shaped = node_client(redis_server, prefix, "The capital of France is", "--max-tokens", "10",
                         "--response-format", json.dumps(CODE))
    samples = node_client(redis_server, prefix, "The capital of France is", "--max-tokens", "5",
                          "--temperature", "1", "--n", "3")
    worker.stop()
    assert samples.returncode == 0, samples.stderr
    printed = re.findall(r"--- sample (\d) \(length\) ---\n", samples.stdout)
    assert sorted(printed) == ["0", "1", "2"]
    assert samples.stderr == "[3 samples: 5 prompt + 15 generated tokens]\n"
    (ref,) = tiny_llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=10, temperature=0, response_format=CODE))
    assert shaped.returncode == 0, shaped.stderr
    assert re.fullmatch(CODE["pattern"], ref.text) and shaped.stdout == ref.text + "\n"
    (ref,) = tiny_llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=6, temperature=0, logprobs=2, repetition_penalty=1.3, logit_bias={13: 2.0}))
    text, *lines = scored.stdout.split("\n")[:-1]
    assert scored.returncode == 0, scored.stderr
    assert text == ref.text and len(lines) == 6
    for line, token, lp in zip(lines, ref.token_ids, ref.logprobs):
        got = json.loads(line)
        assert got["token_id"] == token and abs(got["logprob"] - lp.logprob) < 1e-5
        assert [t for t, _ in got["top_logprobs"]] == [t for t, _ in lp.top]
    (ref,) = tiny_llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=1))
    assert prompt_scored.returncode == 0, prompt_scored.stderr
    entries = json.loads(prompt_scored.stdout.split("\n")[1])["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ref.prompt_logprobs) == 5
    for got, want in zip(entries[1:], ref.prompt_logprobs[1:]):
        assert abs(got["logprob"] - want.logprob) < 1e-5
        assert [t for t, _ in got["top_logprobs"]] == [t for t, _ in want.top]
    (expected,) = tiny_llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text + "\n"
    assert done.stderr == (f"[{expected.finish_reason}: 5 prompt + {len(expected.token_ids)} "
                           "generated tokens]\n")
    assert refused.returncode == 1 and refused.stderr.startswith("error (too_long): prompt:")
