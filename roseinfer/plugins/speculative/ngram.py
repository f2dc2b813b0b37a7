"""Prompt lookup: find the sequence's last n tokens earlier in its prompt or output and
propose what followed them there. Free to run (numpy on the host), and right
wherever the output repeats its input: summaries, edits, extraction, quoting."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from roseinfer.core.speculation import Draft

MAX_N, MIN_N = 4, 2  # longest n-gram tried first; a single token matches too often


class Ngram:
    def __init__(self, ctx):
        pass

    def propose(self, token_ids: list[list[int]], room: list[int]) -> list:
        return [_lookup(np.asarray(ids, dtype=np.int64), n) for ids, n in zip(token_ids, room)]


def _lookup(ids: np.ndarray, room: int):
    """What followed an earlier occurrence of the longest suffix that has one: the latest
    occurrence that a whole draft follows, else the earliest (in a loop the latest is
    the suffix shifted by one, followed by one token)."""
    size = len(ids)
    for n in range(min(MAX_N, size - 1), MIN_N - 1, -1):
        # windows that start early enough for a token to follow them
        hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + room <= size]
            follow = int(whole[-1] if whole.size else hits[0]) + n
            return Draft(ids[follow:follow + room].tolist())
    return None
