"""`roseinfer worker`, `submit`, `status` and `serve` as real processes."""
import json
import re
import shlex
import signal
import socket
import subprocess

import pytest

from roseinfer import SamplingParams
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.server import free_port

from .conftest import CODE, engine_flags, roseinfer_cmd as roseinfer

PROMPT = "The capital of France is"


@pytest.fixture
def expected(tiny_llm):
    (out,) = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))
    return out


def stop(proc, sig=signal.SIGTERM):
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_worker_and_submit_processes(tiny_gpt2_dir, tiny_llm, expected, redis_server, prefix):
    worker = subprocess.Popen(roseinfer("worker", "--redis-url", redis_server.url, "--prefix", prefix,
                                        *engine_flags(tiny_gpt2_dir)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Queued before the worker is up: it creates the group from the stream's start.
        warmup = Client(redis_server.url, prefix).generate("hi", max_tokens=1, timeout=60)
        assert warmup.finish_reason == "length"
        submit = ["submit", PROMPT, "--redis-url", redis_server.url, "--prefix", prefix,
                  "--max-tokens", "10", "--temperature", "0"]
        streamed = subprocess.run(roseinfer(*submit), capture_output=True, text=True, timeout=60)
        whole = subprocess.run(roseinfer(*submit, "--no-stream"), capture_output=True, text=True, timeout=60)
        bad = subprocess.run(roseinfer(*submit, "--top-p", "2"), capture_output=True, text=True, timeout=60)
        scored = subprocess.run(roseinfer(*submit, "--no-stream", "--logprobs", "2",
                                          "--prompt-logprobs", "1",
                                          "--repetition-penalty", "1.3", "--logit-bias", "13:2"),
                                capture_output=True, text=True, timeout=60)
        shaped = subprocess.run(roseinfer(*submit, "--response-format", json.dumps(CODE)),
                                capture_output=True, text=True, timeout=60)
        chat = subprocess.run(roseinfer("submit", *submit[2:], "--messages-file", "-"), text=True,
                              input='[{"role": "user", "content": "Hi"}]', capture_output=True,
                              timeout=60)
        samples = subprocess.run(roseinfer(*submit, "-n", "3", "--temperature", "1",
                                           "--seed", "5"),
                                 capture_output=True, text=True, timeout=60)
        status = subprocess.run(roseinfer("status", "--redis-url", redis_server.url, "--prefix", prefix,
                                          "--json"), capture_output=True, text=True, timeout=60)
    finally:
        code, _, log = stop(worker)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == whole.stdout == expected.text + "\n"
    assert streamed.stderr.endswith(f"[{expected.finish_reason}: 5 prompt + "
                                    f"{len(expected.token_ids)} generated tokens]\n")
    assert bad.returncode == 1 and "error (bad_request): top_p: must be in (0, 1]" in bad.stderr
    (ref,) = tiny_llm.generate([PROMPT], SamplingParams(
        max_tokens=10, temperature=0, logprobs=2, prompt_logprobs=1, repetition_penalty=1.3,
        logit_bias={13: 2.0}))
    text, prompt_line, *lines = scored.stdout.split("\n")[:-1]
    assert text == ref.text and len(lines) == len(ref.token_ids)
    prompt_scored = json.loads(prompt_line)["prompt_logprobs"]
    assert prompt_scored[0] is None and len(prompt_scored) == len(ref.prompt_logprobs)
    assert all(abs(got["logprob"] - want.logprob) < 1e-5 and len(got["top_logprobs"]) == 1
               for got, want in zip(prompt_scored[1:], ref.prompt_logprobs[1:]))
    for line, token, lp in zip(lines, ref.token_ids, ref.logprobs):
        got = json.loads(line)
        assert got["token_id"] == token and abs(got["logprob"] - lp.logprob) < 1e-5
        assert len(got["top_logprobs"]) == 2
    (ref,) = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0,
                                                        response_format=CODE))
    assert shaped.returncode == 0, shaped.stderr
    assert re.fullmatch(CODE["pattern"], ref.text) and shaped.stdout == ref.text + "\n"
    (refs,) = tiny_llm.generate([PROMPT], SamplingParams(n=3, max_tokens=10, temperature=1,
                                                         seed=5))
    assert samples.returncode == 0, samples.stderr
    printed = re.findall(r"--- sample (\d) \((\w+)\) ---\n(.*?)\n(?=---|$)", samples.stdout, re.S)
    assert sorted(printed) == [(str(i), r.finish_reason, r.text) for i, r in enumerate(refs)]
    assert samples.stderr.startswith("[3 samples: 5 prompt + ")
    # The messages reach the worker, whose tiny model has no template to render them.
    assert chat.returncode == 1 and "messages: this worker's model has no chat template" \
        in chat.stderr
    assert code == 0, log
    assert "rejected" in log and "stopped" in log
    found = json.loads(status.stdout)
    assert [(w["pid"], w["status"]) for w in found["workers"]] == [(worker.pid, "serving")]
    assert (found["waiting"], found["pending"], found["dead"]) == (0, 0, 0)


def test_serve_runs_an_embedded_redis_and_stops_on_ctrl_c(tiny_gpt2_dir, expected):
    port, api_port = free_port(), free_port()
    serve = subprocess.Popen(roseinfer("serve", "--port", str(port), "--gateway-port", str(api_port),
                                       *engine_flags(tiny_gpt2_dir)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = [serve.stdout.readline() for _ in range(4)]
        url = f"redis://127.0.0.1:{port}"
        assert url in banner[0]
        assert banner[1].split()[:2] == ["roseinfer", "submit"] and f"--redis-url {url}" in banner[1]
        # The gateway it starts: the banner's curl command, as printed, gets the reply.
        api = f"http://127.0.0.1:{api_port}/v1"
        assert api in banner[2] and banner[3].split()[:2] == ["curl", f"{api}/chat/completions"]
        reply = subprocess.run(shlex.split(banner[3]), capture_output=True, text=True, timeout=60)
        # The tiny GPT-2 has no chat template: the worker's refusal, in OpenAI's shape.
        error = json.loads(reply.stdout)["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        result = Client(url).generate(PROMPT, max_tokens=10, temperature=0, timeout=30)
    finally:
        code, _, log = stop(serve, signal.SIGINT)
    assert code == 0, log
    assert result.token_ids == expected.token_ids
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the embedded Redis outlived serve"
