"""The LoRA adapters an engine serves: their names, the ones held in host memory, and the
ones resident in the model's adapter slots (layers/lora.py).

A request names an adapter. When it is admitted its adapter takes a slot: the one that
holds it already, else the least recently used slot no running request uses, which is
filled from host memory (read from disk first if host memory let it go). A request
whose adapter finds no free slot waits, and the requests behind it go ahead. Every rank
of a tensor-parallel group fills the same slot with its own shard (``announce``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

from roseinfer.core.errors import ConfigError, InvalidRequestError
from roseinfer.models.lora_adapter import Adapter

log = logging.getLogger(__name__)


class Loras:
    def __init__(self, modules: dict, read: Callable[[str, str], Adapter], max_loras: int,
                 max_cpu_loras: int,
                 announce: Callable[[int, str, str], None] = lambda slot, name, path: None):
        self.modules, self.read, self.announce = modules, read, announce
        self.paths: dict[str, str] = {}
        self.host: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.max_cpu_loras = max_cpu_loras
        self.resident: list[Optional[str]] = [None] * max_loras  # by slot
        self.users = [0] * max_loras
        self.recent: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))
        self.num_swaps, self.swap_s = 0, 0.0

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    def add(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name``; it is read and checked now."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigError(f"an adapter's name must be a non-empty string without "
                              f"surrounding spaces, got {name!r}")
        if name in self.paths:
            raise ConfigError(f"adapter {name!r} is loaded already (from "
                              f"{self.paths[name]}): remove it first to load another")
        adapter = self.read(name, str(path))
        self.paths[name] = str(path)
        self._hold(adapter)
        log.info("event=lora_added name=%s path=%s rank=%d bytes=%d", name, path, adapter.rank,
                 adapter.nbytes())

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (its requests must have ended: Engine.remove_lora)."""
        self.check(name)
        del self.paths[name]
        self.host.pop(name, None)
        if name in self.resident:
            self.resident[self.resident.index(name)] = None

    def check(self, name: str) -> None:
        if name not in self.paths:
            raise InvalidRequestError("lora", f"unknown adapter {name!r}; this engine serves "
                                      f"{self.names or 'none'}")

    def acquire(self, seq) -> bool:
        """A slot holding ``seq``'s adapter, filled now if need be; False if every slot
        serves running requests of other adapters."""
        name = seq.lora
        slot = self.resident.index(name) if name in self.resident else self._free_slot()
        if slot is None:
            return False
        if self.resident[slot] != name:
            self.load(slot, name, self.paths[name])
            self.announce(slot, name, self.paths[name])
        self.users[slot] += 1
        self.recent.move_to_end(slot)
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        if seq.lora_slot >= 0:
            self.users[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def _free_slot(self) -> Optional[int]:
        return next((s for s in self.recent if self.users[s] == 0), None)

    def load(self, slot: int, name: str, path: str) -> None:
        """Fill ``slot`` with the adapter (on every rank: the other ranks' ``announce``)."""
        start = time.perf_counter()
        adapter = self.host.get(name)
        if adapter is None or adapter.path != path:
            adapter = self.read(name, path)
        self._hold(adapter)
        for key, module in self.modules.items():
            module.load(slot, adapter.weights.get(key))
        self.resident[slot] = name
        self.num_swaps += 1
        self.swap_s += time.perf_counter() - start

    def _hold(self, adapter: Adapter) -> None:
        """Keep ``adapter`` in host memory, letting the least recently used go past
        max_cpu_loras (it is read from disk again when next needed)."""
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def status(self) -> dict:
        """What status reports: the adapters served, and those in slots now."""
        return {"adapters": self.names,
                "resident": sorted(n for n in self.resident if n is not None),
                "swaps": self.num_swaps}
