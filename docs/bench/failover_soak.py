"""Soak the case that once lost a chunk: a worker killed during a Sentinel failover.

Each run starts a primary, its replica and three Sentinels (down-after 1000 ms), and two
`roseinfer worker` processes on a tiny random GPT-2 (--claim-idle-ms 1000); streams 32
greedy requests of 160 tokens (the last 4 submitted inside the failover's window);
SIGKILLs the primary once some reply streams exist, then worker ``a`` after a short
delay, so that ``b`` takes a's requests over from the new primary. The number of streams
before the kill and the delay come from the run's seed.

Per run it prints how many reply chunks the replica lacked when the primary died (lost:
at least what the workers had to send again), then, from the reply streams as the new
primary holds them (XRANGE): the
seqs missing inside a stream (gaps), the seqs written twice (duplicates: allowed, clients
drop them), the streams whose chunks a client would keep with a hole in seq (a seq written
after a later one is dropped as seen: client_gaps), whether what a client keeps equals a
run without the failover, and how many requests ``b`` resumed (taken over mid-stream). A run with a gap or a wrong stream keeps its workers' and
Sentinels' logs under --out.

    python3 docs/bench/failover_soak.py [--runs 200] [--seed 0] [--ack-replicas 1]
        [--replica-lag 0.5] [--busy 2] [--out DIR]
"""
import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import redis

from roseinfer import LLM, SamplingParams
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.connection import connect
from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
from roseinfer.frontends.redis_streams.protocol import Keys, accepted_chunks, decode_chunk
from roseinfer.frontends.redis_streams.server import EmbeddedRedis, EmbeddedSentinel, free_port

NAME = "soak-primary"
PROMPTS = [f"Request {i} begins" for i in range(32)]
LATE = 28
TOKENS = 160
ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8",
          "--num-kv-blocks", "160", "--no-cuda-graphs"]


def tiny_gpt2(path: str) -> str:
    """The tests' tiny GPT-2: random weights (seed 0) beside GPT-2's real tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from roseinfer.models.tokenizers import gpt2_tokenizer

    gpt2_tokenizer(os.path.join(path, "tokenizer-cache")).save_pretrained(path)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=256)).save_pretrained(path)
    return path


def wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.01)


class Fleet:
    """A primary, its replica, three Sentinels and two worker processes."""

    def __init__(self, model: str, flags: list[str], logs: str):
        self.workers, self.sentinels, self.replica = {}, [], None
        self.primary = EmbeddedRedis(port=free_port()).start()
        self.replica = EmbeddedRedis(port=free_port(), extra_args=(
            "--replicaof", "127.0.0.1", str(self.primary.port))).start()
        self.sentinels = [EmbeddedSentinel(free_port(), self.primary.port, NAME).start()
                          for _ in range(3)]
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) \
            + f"/{NAME}"
        self.prefix = f"soak{random.randrange(1 << 30)}"
        self.logs = logs
        self.model, self.flags = model, flags

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for name in ("a", "b"):
            cmd = [sys.executable, "-m", "roseinfer.cli", "worker", "--redis-url", self.url,
                   "--prefix", self.prefix, "--consumer", name, "--heartbeat-s", "0.2",
                   "--claim-idle-ms", "1000", *self.flags, "--model", self.model, *ENGINE]
            log = open(os.path.join(self.logs, f"worker-{name}.log"), "w")
            self.workers[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                                  env=env)
        keys = Keys(self.prefix)
        wait_until(lambda: {h["consumer"] for h in read_heartbeats(connect(self.url), keys)}
                   >= {"a", "b"}, 120)
        wait_until(lambda: redis.Redis(port=self.replica.port).info("replication")
                   ["master_link_status"] == "up", 30)

    def close(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for i, s in enumerate(self.sentinels):
            shutil.copy(os.path.join(s._dir, "redis.log"),
                        os.path.join(self.logs, f"sentinel-{i}.log"))
        for server in (*self.sentinels, self.replica, self.primary):
            if server is not None:
                server.stop()


def chunks_held(port: int, prefix: str) -> int:
    """Reply chunks a server holds, all streams together."""
    server = redis.Redis(port=port)
    return sum(server.xlen(k) for k in server.keys(f"{prefix}:out:*"))


def streams_exist(fleet: Fleet, n: int) -> bool:
    return len(redis.Redis(port=fleet.primary.port).keys(f"{fleet.prefix}:out:*")) >= n


def one_run(fleet: Fleet, rng: random.Random, want: list, replica_lag_s: float = 0.0) -> dict:
    started, delay = rng.randint(1, 16), rng.uniform(0.0, 1.5)
    client = Client(fleet.url, fleet.prefix)
    rids = [client.submit(p, max_tokens=TOKENS, temperature=0, ignore_eos=True)
            for p in PROMPTS[:LATE]]
    late, killed = {}, threading.Event()

    def submit_late(i):
        killed.wait()
        late[i] = client.submit(PROMPTS[i], max_tokens=TOKENS, temperature=0, ignore_eos=True)

    threads = [threading.Thread(target=submit_late, args=(i,)) for i in range(LATE, 32)]
    for t in threads:
        t.start()
    wait_until(lambda: streams_exist(fleet, started), 60)
    replica = redis.Redis(port=fleet.replica.port)
    if replica_lag_s:
        # The replica follows a port where nothing listens, keeping its data, so that
        # what the primary takes meanwhile never reaches it (a stopped replica would not
        # do: the kernel still takes what the primary sends, and a cut link reconnects).
        replica.replicaof("127.0.0.1", free_port())
        time.sleep(replica_lag_s)
    taken = chunks_held(fleet.primary.port, fleet.prefix)
    fleet.primary.stop(kill=True)
    if replica_lag_s:  # back under the dead primary, for the Sentinels to promote
        replica.replicaof("127.0.0.1", fleet.primary.port)
    lost = taken - chunks_held(fleet.replica.port, fleet.prefix)
    killed.set()
    time.sleep(delay)
    fleet.workers["a"].kill()
    for t in threads:
        t.join(60)
    rids += [late[i] for i in range(LATE, 32)]
    server = connect(fleet.url)
    keys = Keys(fleet.prefix)
    wait_until(lambda: all(_finished(server, keys, rid) for rid in rids), 180)
    gaps, dups, skipped, wrong = [], 0, [], []
    for i, rid in enumerate(rids):
        entries = server.xrange(keys.out(rid))
        chunks = [decode_chunk(f) for _, f in entries]
        seqs = collections.Counter(c.seq for c in chunks)
        dups += sum(n - 1 for n in seqs.values())
        missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
        if missing:
            gaps.append((rid, missing))
        kept = accepted_chunks(entries)  # what a client keeps, in stream order
        if [c.seq for c in kept] != list(range(len(kept))):
            skipped.append((rid, [c.seq for c in chunks]))
        if sum((c.token_ids for c in kept), []) != want[i].token_ids:
            wrong.append(rid)
        if missing or wrong[-1:] == [rid] or skipped[-1:] == [(rid, [c.seq for c in chunks])]:
            with open(os.path.join(fleet.logs, f"stream-{rid}.txt"), "w") as f:
                f.write(f"want {want[i].token_ids}\n")
                for (entry_id, _), c in zip(entries, chunks):
                    f.write(f"{entry_id.decode()} seq {c.seq} {c.token_ids} {c.finish_reason} "
                            f"{c.error or ''}\n")
    return {"started": started, "delay_s": round(delay, 3), "lost": lost, "gaps": gaps,
            "duplicates": dups,
            "client_gaps": skipped, "wrong": wrong}


def _finished(server, keys: Keys, rid: str) -> bool:
    last = server.xrevrange(keys.out(rid), count=1)
    return bool(last) and decode_chunk(last[0][1]).finished


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="run i uses seed + i")
    ap.add_argument("--ack-replicas", type=int, default=0)
    ap.add_argument("--out", default="failover-soak", help="logs of the runs that failed")
    ap.add_argument("--replica-lag", type=float, default=0.0,
                    help="take the replica off the primary this many seconds before it dies "
                         "(under REPLAY_S, 2 s), so that the primary's last writes are lost "
                         "in the failover: the workers must send them again")
    ap.add_argument("--busy", type=int, default=0,
                    help="processes that spin beside the runs: a loaded machine, as when the "
                         "whole test suite runs")
    args = ap.parse_args()
    # Stopped with SIGTERM, it still stops the servers and workers of the run under way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        soak(args)
    finally:
        for p in spinners:
            p.kill()


def soak(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    model = tiny_gpt2(tempfile.mkdtemp(prefix="soak-model-"))
    want = LLM(model, device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=160,
               cuda_graphs=False).generate(PROMPTS, SamplingParams(
                   max_tokens=TOKENS, temperature=0, ignore_eos=True))
    flags = ["--ack-replicas", str(args.ack_replicas)] if args.ack_replicas else []
    failed = 0
    for i in range(args.runs):
        seed = args.seed + i
        logs = tempfile.mkdtemp(prefix=f"soak-{seed}-")
        t0 = time.monotonic()
        fleet = Fleet(model, flags, logs)
        try:
            fleet.start()
            result = one_run(fleet, random.Random(seed), want, args.replica_lag)
        except Exception as e:  # noqa: BLE001 - a run that hangs or breaks is a failure too
            result = {"error": f"{type(e).__name__}: {e}", "gaps": [], "wrong": []}
        finally:
            fleet.close()
        with open(os.path.join(logs, "worker-b.log")) as f:
            result["resumed"] = f.read().count("event=resumed")
        bad = bool(result.get("error") or result["gaps"] or result.get("client_gaps")
                   or result["wrong"])
        failed += bad
        if bad:
            shutil.copytree(logs, os.path.join(args.out, f"seed-{seed}"), dirs_exist_ok=True)
        shutil.rmtree(logs, ignore_errors=True)
        print(f"run {i} seed {seed} ({time.monotonic() - t0:.0f} s): "
              + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    print(f"{args.runs} runs, {failed} with a gap, a wrong stream or an error")


if __name__ == "__main__":
    main()
