"""Logits processors: plugins that change a request's logits before it samples.

A request names the ones it wants (``SamplingParams.logits_processors``,
name -> args; ``response_format`` names the config's ``structured_output``
one). Each processor is built once per engine, on first use; it starts one
state per request, is applied once per step to all its rows together, and
its states see every token their sequence takes.

A processor may also have ``prepare(args)``: the work that grows with the
args (compiling a grammar: seconds for some small hostile patterns), which
frontends run off the step loop before they add the request (the Redis
worker's reader thread), so that ``start`` is quick after it.

Such a request's next mask depends on the token it sampled last, which is
still in flight when the next step launches: the runner queues that step's
forward first, then waits for the previous step's tokens alone (not for the
step it queued), hands the constrained rows theirs (``accept_early``) and
fills their masks while the forward runs; the engine's bookkeeping of the
previous step stays overlapped with the GPU as for any step. Such batches run
no decode windows: each step needs the host in between. (Collecting the
previous step before scheduling the next instead was measured 0.53x against
this path's 0.77x of plain throughput, Llama-1B shape: docs/benchmarks.md.)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.plugins import PluginRegistry, UnknownPluginError
from roseinfer.core.reasoning import Gated


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor's factory gets."""
    tokenizer: Any           # None for a model without one
    vocab_size: int          # the logits' width
    eos_ids: frozenset[int]
    device: torch.device


class Processors:
    """The engine's logits processors, built by name on first use."""

    def __init__(self, plugins: PluginRegistry, context: ProcessorContext,
                 structured_output: str):
        self.plugins, self.context = plugins, context
        self.structured_output = structured_output
        self.built: dict[str, Any] = {}
        self.lock = threading.Lock()  # prepare() runs on frontends' threads

    def prepare(self, params) -> None:
        """Each named processor's ``prepare``, where it has one; raises as ``start``."""
        for processor, args, field in self._wanted(params):
            if hasattr(processor, "prepare"):
                _refuse_bad_args(field, processor.prepare, args)

    def start(self, params, prompt_ids: list[int]) -> list[tuple[Any, Any]]:
        """(processor, state) for each processor ``params`` names; raises
        InvalidRequestError for an unknown name or args the processor refuses. The
        structured output of a request with an ``answer_gate`` waits for its answer."""
        started = []
        for processor, args, field in self._wanted(params):
            state = _refuse_bad_args(field, processor.start, args, prompt_ids)
            if params.answer_gate is not None and field == "response_format":
                state = Gated(state, params.answer_gate, self.context.tokenizer)
            started.append((processor, state))
        return started

    def _wanted(self, params):
        wanted = dict(params.logits_processors)
        if params.response_format is not None:
            wanted[self.structured_output] = params.response_format
        for name, args in wanted.items():
            field = "response_format" if name == self.structured_output else "logits_processors"
            yield self._get(name, field), args, field

    def _get(self, name: str, field: str):
        with self.lock:
            if name not in self.built:
                try:
                    factory = self.plugins.get("logits_processor", name).factory
                except UnknownPluginError as e:
                    raise InvalidRequestError(field, str(e)) from None
                self.built[name] = factory(self.context)
            return self.built[name]


def _refuse_bad_args(field: str, call, *args):
    try:
        return call(*args)
    except ValueError as e:
        raise InvalidRequestError(field, str(e)) from None


def apply(logits: torch.Tensor, seqs) -> None:
    """Every processor of ``seqs`` (row i of ``logits`` is seqs[i]) on its rows, in place.
    A gated state (Gated) is skipped while closed; while "maybe", its row keeps the
    thinking's opening token besides the processor's."""
    groups: dict[int, tuple[Any, list[int], list[Any]]] = {}
    opening = []  # (row, token) of "maybe" rows
    for row, seq in enumerate(seqs):
        for processor, state in seq.constraints:
            if isinstance(state, Gated):
                if state.phase == "closed":
                    continue
                if state.phase == "maybe":
                    opening.append((row, state.gate.start))
                state = state.inner
            _, rows, states = groups.setdefault(id(processor), (processor, [], []))
            rows.append(row)
            states.append(state)
    kept = [logits[row, token].clone() for row, token in opening]
    for processor, rows, states in groups.values():
        processor.apply(logits, rows, states)
    for (row, token), value in zip(opening, kept):
        logits[row, token] = value


def accept_early(seq, token: int) -> None:
    """The token ``seq`` sampled last, before the engine takes it (catch_up skips it)."""
    for _, state in seq.constraints:
        state.accept([token])
    seq.num_accepted += 1


def catch_up(seq) -> None:
    """The generated ids of ``seq`` its states have not seen yet, to each of them."""
    new = seq.token_ids[seq.num_prompt_tokens + seq.num_accepted:]
    if new:
        for _, state in seq.constraints:
            state.accept(new)
        seq.num_accepted += len(new)
