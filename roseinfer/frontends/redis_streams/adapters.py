"""LoRA adapters loaded and unloaded while workers run, through one stream every worker
reads: ``P:adapters``, entries ``op load|unload``, ``name``, ``path`` (docs/protocol.md,
"Adapters").

A worker started with ``--enable-lora`` reads the whole stream when it starts, so it
serves what was loaded before it came, and then each new entry in the round that reads
cancels. Each worker says in its heartbeat which adapters it serves and why one failed
(``adapters``, ``adapter_errors``); ``roseinfer lora`` and the gateway wait on that.
"""
from __future__ import annotations

import logging
import time

from roseinfer.core.errors import ConfigError, InvalidRequestError
from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
from roseinfer.frontends.redis_streams.protocol import Keys

log = logging.getLogger(__name__)
OPS = ("load", "unload")


def entry(op: str, name: str, path: str = "") -> dict:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return {"op": op, "name": name, "path": path}


class Adapters:
    """A worker's side: applies the stream's entries to its engine, in order."""

    def __init__(self, engine):
        self.engine = engine
        self.errors: dict[str, str] = {}  # adapter -> why its last entry failed here

    def apply(self, entries: list) -> None:
        for _, fields in entries:
            f = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
            self._apply(f.get("op"), f.get("name", ""), f.get("path", ""))

    def _apply(self, op, name: str, path: str) -> None:
        self.errors.pop(name, None)
        try:
            if op == "load":
                self._load(name, path)
            elif op == "unload":
                self.engine.remove_lora(name)
            else:
                raise ConfigError(f"unknown op {op!r}: load or unload")
        except (ConfigError, InvalidRequestError) as e:
            self.errors[name] = str(e)
            log.warning("event=adapter_failed op=%s name=%s error=%s", op, name, e)
            return
        log.info("event=adapter_%sed name=%s path=%s", op, name, path)

    def _load(self, name: str, path: str) -> None:
        """Load; an adapter loaded from the same path already stays as it is."""
        loras = self.engine.loras
        if loras.paths.get(name) == path:
            return
        if name in loras.paths:
            self.engine.remove_lora(name)
        self.engine.add_lora(name, path)

    def status(self) -> dict:
        return {"adapters": self.engine.lora_names, "adapter_errors": dict(self.errors)}


def request(redis, keys: Keys, op: str, name: str, path: str = "",
            timeout_s: float = 30.0) -> dict[str, str]:
    """Ask every worker to load or unload ``name``, and wait until each live worker that
    serves adapters reports it done or failed; returns {worker: "ok" or its error}."""
    redis.xadd(keys.adapters, entry(op, name, path))
    deadline = time.monotonic() + timeout_s
    while True:
        results = {}
        for beat in read_heartbeats(redis, keys):
            if "adapters" not in beat:
                continue  # a worker without --enable-lora
            error = beat.get("adapter_errors", {}).get(name)
            done = (name in beat["adapters"]) == (op == "load")
            results[beat["consumer"]] = error or ("ok" if done else None)
        if (results and None not in results.values()) or time.monotonic() > deadline:
            return {k: v or "no answer yet" for k, v in results.items()}
        time.sleep(0.2)
