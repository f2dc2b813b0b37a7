"""Fixtures of the Redis frontend tests: a real redis-server, fakeredis, a fake engine that
follows the engine contract, a tiny random GPT-2 with the real GPT-2 tokenizer, and a
worker running in a thread."""
from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import fakeredis
import pytest
import redis

from roseinfer.core.config import EngineConfig
from roseinfer.core.engine import EngineStats
from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams.protocol import Keys, decode_chunk
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
from roseinfer.frontends.redis_streams.worker import Worker

# The repeated failover tests (test_sentinel.py, test_cluster.py) run each kind this many
# times: each run is 10-15 s of a Sentinel or cluster failing over. A soak runs them more:
# ROSEINFER_FAILOVER_RUNS=10 python3 -m tests -k "failovers or kills"
FAILOVER_RUNS = int(os.environ.get("ROSEINFER_FAILOVER_RUNS", "3"))


WORDS = "the a red fox jumps over lazy dog in Paris capital of France is what".split()


# --- reading reply streams -----------------------------------------------------------------

def raw_chunks(redis, prefix, rid):
    """Every chunk on the reply stream, duplicates included: what the client de-duplicates."""
    return [decode_chunk(f) for _, f in redis.xrange(Keys(prefix).out(rid))]


def assert_well_formed(chunks, n=1):
    """seq contiguous from 0; each of the n samples' chunks end in its one final chunk,
    whose usage counts them; the stream ends with the last of those."""
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].finished
    for i in range(n):
        mine = [c for c in chunks if (c.index or 0) == i]
        assert all(c.index == (i if n > 1 else None) for c in mine)
        assert [c.finished for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].usage["completion_tokens"] == sum(len(c.token_ids) for c in mine)


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def pending(redis, prefix):
    return redis.xpending(Keys(prefix).requests, "workers")["pending"]


# --- the fake engine ---------------------------------------------------------------------

@dataclass
class _FakeSeq:
    prompt_ids: list
    params: object
    out_ids: list = field(default_factory=list)
    aborted: bool = False
    poisoned: bool = False


@dataclass
class FakeOutput:
    """The RequestOutput fields of the engine contract."""
    request_id: str
    prompt_token_ids: list
    token_ids: list
    text: str
    new_token_ids: list
    new_text: str
    finished: bool
    finish_reason: object
    new_logprobs: object = None
    prompt_logprobs: object = None
    index: int = 0
    error: object = None
    num_cached_tokens: int = 0


class FakeEngine:
    """The engine contract with a toy model: after token t comes t+1 (mod vocab), and token
    t reads as the letter 'a' + t % 26. Prompt text becomes ids by ord(c) % vocab.

    step_s slows each step down; a request whose prompt is ``poison`` makes every step
    after its first token raise, as an engine bug triggered by one request would."""
    vocab_size = 100
    max_model_len = 64
    step_kind = "eager"

    def __init__(self, max_num_seqs: int = 4, step_s: float = 0.0, poison: Optional[str] = None):
        self.config = EngineConfig(device="cpu", max_num_seqs=max_num_seqs)
        self.tokenizer = None
        self.seqs: dict[str, _FakeSeq] = {}
        self.steps = 0
        self.step_s = step_s
        self.poison = poison
        self.added = []  # every rid ever added, probes included

    def add_request(self, rid, prompt, params, emitted_ids=None, emitted_text=None):
        ids = [ord(c) % self.vocab_size for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"ids must be in [0, {self.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("prompt", "prompt + max_tokens is too long", "too_long")
        emitted = list(emitted_ids or [])
        if len(emitted) >= params.max_tokens:
            raise InvalidRequestError("emitted_ids", "the request already has all its tokens")
        assert rid not in self.seqs, f"duplicate rid {rid}"
        self.seqs[rid] = _FakeSeq(ids, params, emitted, poisoned=prompt == self.poison)
        self.added.append(rid)

    def step(self):
        self.steps += 1
        time.sleep(self.step_s)
        batch = list(self.seqs.values())[: self.config.max_num_seqs]
        if any(s.poisoned and s.out_ids and not s.aborted for s in batch):
            raise RuntimeError("poisoned batch")
        outs = []
        for rid, s in list(self.seqs.items())[: self.config.max_num_seqs]:
            new = [] if s.aborted else [((s.out_ids or s.prompt_ids)[-1] + 1) % self.vocab_size]
            s.out_ids += new
            reason = ("abort" if s.aborted else "stop" if new[0] in s.params.stop_token_ids
                      else "length" if len(s.out_ids) >= s.params.max_tokens else None)
            if reason:
                del self.seqs[rid]
            outs.append(FakeOutput(rid, s.prompt_ids, list(s.out_ids), _text(s.out_ids), new,
                                      _text(new), reason is not None, reason))
        return outs

    def abort(self, rid):
        if rid in self.seqs:
            self.seqs[rid].aborted = True

    def has_unfinished(self):
        return bool(self.seqs)

    def num_unfinished(self):
        return len(self.seqs)

    def stats(self):
        running = min(len(self.seqs), self.config.max_num_seqs)
        return EngineStats(running, len(self.seqs) - running, running / self.config.max_num_seqs, 0)


def _text(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture
def fake_engine():
    return FakeEngine()


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis()


# --- a real Redis ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture
def real_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def prefix():
    """Each test gets its own keys on the shared server."""
    return f"t-{uuid.uuid4().hex[:8]}"


class WorkerThread:
    """A Worker running in a thread; stop() drains it and re-raises what killed it, if anything."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.worker.run()
        except BaseException as e:  # surfaced by stop(): a dead worker must fail the test
            self.error = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, grace_s: float = 10.0):
        self.worker.stop(grace_s)
        self.thread.join(grace_s + 10)
        assert not self.thread.is_alive(), "the worker did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture
def start_worker_on(prefix):
    """start_worker_on(redis_client, engine, **worker_kwargs) -> WorkerThread, stopped at
    teardown."""
    started = []

    def start(client, engine, **kwargs):
        kwargs = {"prefix": prefix, "block_ms": 100, **kwargs}
        w = WorkerThread(Worker(engine, client, **kwargs))
        w.thread.start()
        started.append(w)
        return w

    yield start
    for w in started:
        if w.alive():
            w.stop()


@pytest.fixture
def start_worker(redis_server, start_worker_on):
    """start_worker(engine, **worker_kwargs) -> WorkerThread on the real Redis, stopped at teardown."""
    return lambda engine, **kwargs: start_worker_on(redis.Redis.from_url(redis_server.url),
                                                    engine, **kwargs)


# --- a tiny GPT-2 with the real GPT-2 tokenizer ------------------------------------------

@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    """Random weights saved as a model dir, with GPT-2's real tokenizer beside them."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from roseinfer.models.tokenizers import gpt2_tokenizer

    path = tmp_path_factory.mktemp("tiny-gpt2")
    gpt2_tokenizer(str(tmp_path_factory.mktemp("tokenizer-cache"))).save_pretrained(path)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=256)).save_pretrained(path)
    return str(path)


# A response_format every tiny model's output can satisfy within a few tokens.
CODE = {"type": "regex", "pattern": "[a-z]{3}-[0-9]{2}"}

# 8 sequences of up to 256 tokens fit in 128 blocks of 16; more would only cost start-up time.
TINY_ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "num_kv_blocks": 160,
               "cuda_graphs": False}


@pytest.fixture(scope="session")
def tiny_llm(tiny_gpt2_dir):
    """One engine for the session: tests using it stop their worker before the next starts."""
    from roseinfer import LLM

    return LLM(tiny_gpt2_dir, **TINY_ENGINE)


def roseinfer_cmd(*args):
    return [sys.executable, "-m", "roseinfer.cli", *args]


def status_until(url, prefix, holds, *flags, timeout=30.0):
    """`roseinfer status` run until ``holds(its stdout)`` or ``timeout``; returns the last
    run, for the test's own asserts. A heartbeat key lives three beats (0.6 s for the test
    workers): on a loaded machine one worker's key can lapse between two of its beats, so
    a test waits for the fleet it expects, as it waits for it at start-up."""
    import subprocess

    deadline = time.monotonic() + timeout
    while True:
        status = subprocess.run(roseinfer_cmd("status", "--redis-url", url, "--prefix", prefix,
                                              *flags), capture_output=True, text=True, timeout=60)
        if (status.returncode == 0 and holds(status.stdout)) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


@pytest.fixture
def worker_process(tiny_gpt2_dir, prefix):
    """start(redis_url, consumer, *flags) -> a `roseinfer worker` process on the tiny GPT-2;
    all are gone after the test."""
    import os
    import subprocess

    procs = []

    def start(url, consumer, *flags):
        cmd = roseinfer_cmd("worker", "--redis-url", url, "--prefix", prefix, "--consumer",
                            consumer, "--heartbeat-s", "0.2", *flags, *engine_flags(tiny_gpt2_dir))
        # One thread each: several workers and the test share a small machine.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, env=env))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        # Shown when a test fails: each worker's events say what it did and when.
        print(f"worker {p.args[p.args.index('--consumer') + 1]} log:\n{p.communicate()[1]}")


def engine_flags(model_dir):
    """The CLI flags of TINY_ENGINE on the tiny model."""
    flags = ["--model", model_dir]
    for name, value in TINY_ENGINE.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def run_until_idle(worker, limit=200):
    for _ in range(limit):
        worker.run_once()
        if not worker.engine.has_unfinished() and not worker._inflight:
            worker.run_once()  # flushes the last step's writes
            return
    raise AssertionError("worker did not finish its requests")


@pytest.fixture
def gateway(redis_server, prefix):
    """gateway(**GatewayConfig fields) -> a started BackgroundGateway on the real Redis,
    serving the model name "tiny"; stopped at teardown."""
    from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig

    started = []

    def start(**kw):
        g = BackgroundGateway(GatewayConfig(redis_server.url, prefix, model_name="tiny", **kw),
                              port=free_port())
        started.append(g)
        return g.start()

    yield start
    for g in started:
        g.stop()
