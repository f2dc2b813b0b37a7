"""A step's device work, as every rank of a tensor-parallel group runs it.

Rank 0 schedules and fills the packed inputs (step_inputs.py); the other ranks
need only those ints and how to run them: which graph, how many window steps,
how many rows sample, which KV blocks to copy first. ``encode`` packs all of it
into one int32 array, the one message a step sends to each rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from roseinfer.core.cuda_graphs import Layout

# Header: a message of fewer ints than this is the order to stop.
_HEADER = ("n_tok", "n_seq", "n_upd", "layout", "real_seqs", "n_rows", "steps",
           "max_query_len", "replay", "n_copies", "n_extra_rows")
_NO_LAYOUT, _DECODE, _MIXED, _VERIFY = -1, 0, 1, 2


@dataclass
class StepOrder:
    packed: np.ndarray            # the packed inputs' ints (step_inputs.views of it)
    n_tok: int
    n_seq: int
    n_upd: int
    layout: Optional[Layout]      # the graph that runs it, None: eager
    real_seqs: int                # sequences before padding
    n_rows: int                   # rows that sample a token
    steps: int                    # window steps
    max_query_len: int
    replay: bool                  # the graphs sample and advance by themselves
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV blocks (src, dst)
    # Token rows whose logits are also due: draft positions, then prompt positions.
    extra_rows: list[int] = field(default_factory=list)

    def encode(self) -> np.ndarray:
        layout = _NO_LAYOUT if self.layout is None else _VERIFY if self.layout.all_logits \
            else _MIXED if self.layout.mixed else _DECODE
        head = [self.n_tok, self.n_seq, self.n_upd, layout, self.real_seqs, self.n_rows,
                self.steps, self.max_query_len, int(self.replay), len(self.copies),
                len(self.extra_rows)]
        copies = [i for pair in self.copies for i in pair]
        return np.concatenate([np.array(head + copies + self.extra_rows, dtype=np.int32),
                               self.packed])


def decode(msg: np.ndarray) -> Optional[StepOrder]:
    """The order in ``msg`` (int32), or None for the order to stop."""
    if len(msg) < len(_HEADER):
        return None
    h = dict(zip(_HEADER, msg[:len(_HEADER)].tolist()))
    at = len(_HEADER)
    copies = msg[at:at + 2 * h["n_copies"]].reshape(-1, 2).tolist()
    at += 2 * h["n_copies"]
    extra_rows = msg[at:at + h["n_extra_rows"]].tolist()
    at += h["n_extra_rows"]
    layout = None if h["layout"] == _NO_LAYOUT else \
        Layout(h["n_tok"], h["n_seq"], h["layout"] != _DECODE, h["layout"] == _VERIFY)
    return StepOrder(msg[at:], h["n_tok"], h["n_seq"], h["n_upd"], layout, h["real_seqs"],
                     h["n_rows"], h["steps"], h["max_query_len"], bool(h["replay"]),
                     [tuple(c) for c in copies], extra_rows)


STOP = np.zeros(0, dtype=np.int32)
