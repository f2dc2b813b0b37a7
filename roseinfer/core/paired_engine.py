"""A generating engine and a pooling one on one device, served by one worker: chats and
embedding (or scoring) requests come through the same queue, each to its engine by its
``task``, and the pooling engine yields to the generating one.

A step runs the generating engine's step, then a pooling batch: a whole one (up to
``max_num_batched_tokens``) where nothing generates, one of at most ``beside_tokens``
where sequences only decode, and none where a prompt waits or is being computed, so a
chat's first token waits for at most the pooling batch already running. An embedding job
sent at a priority above 0 (the backlog) thus fills the steps chats leave, and chats
read from the queue take over its slots (the worker's ``_read_slots``). Everything else
a worker asks of an engine (its config, model, tokenizer, scheduler, adapters) is the
generating engine's."""
from __future__ import annotations

import copy
import threading

from roseinfer.core.engine import EngineStats
from roseinfer.core.pooling import Prepared

BESIDE_TOKENS = 512  # a pooling batch's tokens while sequences decode


class PairedEngine:
    step_kind = "generate"

    def __init__(self, generator, pooler, beside_tokens: int = BESIDE_TOKENS,
                 idle_tokens: int | None = None):
        """``idle_tokens``: a pooling batch's tokens where nothing generates (None: the
        pooling engine's whole batch); a chat arriving waits for the batch running."""
        self.generator, self.pooler, self.beside = generator, pooler, beside_tokens
        self.idle = idle_tokens
        self.tasks = ("generate", *pooler.tasks)
        self._pooled: set[str] = set()
        self._tokenizers = threading.local()  # the pooling model's, a copy per thread

    def __getattr__(self, name: str):
        return getattr(self.generator, name)

    def prepare(self, task, tokenizer=None) -> Prepared:
        """The pooling task tokenized by the pooling model's tokenizer (not the generating
        model's, which a worker's reader passes), a copy for each reader thread."""
        own = getattr(self._tokenizers, "tokenizer", None)
        if own is None:
            own = self._tokenizers.tokenizer = copy.deepcopy(self.pooler.tokenizer)
        return self.pooler.prepare(task, own)

    def add_request(self, rid: str, prompt, params=None, **kwargs) -> None:
        if isinstance(prompt, Prepared):
            self.pooler.add_request(rid, prompt, params)
            self._pooled.add(rid)
        else:
            self.generator.add_request(rid, prompt, params, **kwargs)

    def abort(self, rid: str) -> None:
        (self.pooler if rid in self._pooled else self.generator).abort(rid)

    def has_unfinished(self) -> bool:
        return self.generator.has_unfinished() or self.pooler.has_unfinished()

    def num_unfinished(self) -> int:
        return self.generator.num_unfinished() + self.pooler.num_unfinished()

    def stats(self) -> EngineStats:
        ours, pooled = self.generator.stats(), self.pooler.stats()
        ours.num_running += pooled.num_running
        ours.num_waiting += pooled.num_waiting
        return ours

    def step(self) -> list:
        outputs = self.generator.step() if self.generator.has_unfinished() else []
        room = self._pooling_room()
        if self.pooler.has_unfinished() and room != 0:
            pooled = self.pooler.step(room)
            self._pooled.difference_update(o.request_id for o in pooled)
            outputs += pooled
        return outputs

    def close(self) -> None:
        self.pooler.close()
        self.generator.close()

    def _pooling_room(self) -> int | None:
        """Tokens the step's pooling batch may take: ``idle`` where nothing generates, 0
        where a prompt waits or is being computed, else ``beside``."""
        if not self.generator.has_unfinished():
            return self.idle
        return 0 if self.generator.prompts_pending else self.beside
