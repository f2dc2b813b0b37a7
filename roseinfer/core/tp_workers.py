"""The processes of a tensor-parallel group: rank 0 is the engine's own process
(it schedules, samples and talks to Redis); ranks 1..N-1 are started here, each
loads its shards and then runs each step's device work as rank 0 orders it.

Each rank is a fresh ``python -m roseinfer.core.tp_workers`` process (not a
multiprocessing child, which would import the user's ``__main__`` again). A
step reaches it as one int32 message on a pipe (step_order.py), read while the
GPUs still run the step before. A rank that dies takes the group down: rank 0
exits with an error (its requests go back to Redis as on any crash), and a
rank whose rank 0 is gone exits too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from roseinfer.core import tp
from roseinfer.core.config import EngineConfig
from roseinfer.core.errors import ConfigError
from roseinfer.core.step_order import STOP, StepOrder, decode

EXIT_S = 10.0  # for a rank to exit after it was told to stop
# Starts a message that fills a LoRA slot; an order starts with its token count, never -1.
LORA_TAG = np.int32(-1).tobytes()


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Rank r runs on cuda:r (CUDA_VISIBLE_DEVICES picks the GPUs), or on the CPU."""
    if device.type != "cuda" or size == 1:
        return device
    if device.index is not None:
        raise ConfigError(f"device {device} names one GPU, but tensor_parallel_size {size} "
                          "takes cuda:0..N-1; pick them with CUDA_VISIBLE_DEVICES")
    if torch.cuda.device_count() < size:
        raise ConfigError(f"tensor_parallel_size {size} needs {size} GPUs; "
                          f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", rank)


class Peers:
    """Rank 0's handle on the other ranks."""

    def __init__(self, procs: list[subprocess.Popen], conns: list[Connection]):
        self.procs, self.conns = procs, conns
        self.closing = False
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"tp-watch-{rank}").start()

    @classmethod
    def start(cls, spec, config: EngineConfig, device: torch.device) -> "Peers":
        """Start ranks 1..N-1 and join the group as rank 0 (on ``device``)."""
        _check_no_group()
        size, port = config.tensor_parallel_size, _free_port()
        procs, conns = [], []
        for rank in range(1, size):
            read, write = os.pipe()
            cmd = [sys.executable, "-m", "roseinfer.core.tp_workers", "--rank", str(rank),
                   "--size", str(size), "--port", str(port), "--fd", str(read),
                   "--device", device.type, "--model", os.fspath(spec),
                   "--config", json.dumps(dataclasses.asdict(config))]
            procs.append(subprocess.Popen(cmd, pass_fds=(read,)))
            os.close(read)
            conns.append(Connection(write, readable=False))
        peers = cls(procs, conns)
        try:
            tp.init(0, size, port, device, config.enable_expert_parallel)
        except BaseException:
            peers.close(kill=True)
            raise
        return peers

    def send(self, order: StepOrder) -> None:
        msg = order.encode()
        for conn in self.conns:
            conn.send_bytes(msg)

    def send_lora(self, slot: int, name: str, path: str) -> None:
        """Fill adapter slot ``slot`` with ``name`` (each rank reads its own shard), before
        the next order, which may use it."""
        msg = LORA_TAG + json.dumps({"slot": slot, "name": name, "path": path}).encode()
        for conn in self.conns:
            conn.send_bytes(msg)

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks and leave the group (each rank leaves on its own, waiting
        for nobody: tp.destroy); a rank not gone within EXIT_S is killed. ``kill``: at
        once (rank 0 failed, and they may wait in a collective that will never complete)."""
        if self.closing:
            return
        self.closing = True
        if kill:
            for proc in self.procs:
                proc.kill()
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
                conn.close()
            except OSError:
                pass
        tp.destroy(finish=not kill)
        for proc in self.procs:
            try:
                proc.wait(timeout=EXIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing:
            return
        # Rank 0 may be blocked inside a collective that will never complete:
        # only leaving the process ends it.
        msg = (f"roseinfer: tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
               f"{code}; the group cannot run without it, so rank 0 exits too")
        # Straight to fd 2: sys.stderr may be mid-teardown, with the main thread's own
        # error (a collective that lost its peer) racing this one; once in ten runs on
        # the CPU nothing of a print reached the pipe before the exit.
        os.write(2, (msg + "\n").encode())
        os._exit(70)


def _check_no_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError("this process is in a tensor-parallel group already: close the "
                          "engine that made it first (llm.close(), or `with LLM(...) as "
                          "llm:`)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent() -> None:
    """A rank whose rank 0 is gone (killed, say) must not hold its GPU forever."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="tp-parent").start()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="one rank of a tensor-parallel group (started "
                                "by rank 0; not meant to be run by hand)")
    for flag in ("--rank", "--size", "--port", "--fd"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(message)s")
    _exit_with_parent()
    from roseinfer.core import device_side
    from roseinfer.core.plugins import default_registry

    config = EngineConfig(**json.loads(args.config))
    device = rank_device(torch.device(args.device), args.rank, args.size)
    tp.init(args.rank, args.size, args.port, device, config.enable_expert_parallel)
    side = device_side.build(args.model, None, config, default_registry(), device)
    runner, loras = side.runner, side.loras
    del side
    device_side.settle_heap()  # as rank 0 does: no full collection between steps walks the model's objects
    conn = Connection(args.fd, writable=False)
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:  # rank 0 is gone
            break
        if msg.startswith(LORA_TAG):
            loras.load(**json.loads(msg[len(LORA_TAG):]))
            continue
        order = decode(np.frombuffer(msg, dtype=np.int32))
        if order is None:
            break
        runner.follow(order)
    del runner, loras
    device_side.release()  # its CUDA graphs before the group they captured collectives of
    tp.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left that the OS does not free; the interpreter's teardown
    # would only print Triton's binding-leak warnings.
    os._exit(0)


if __name__ == "__main__":
    main()
