"""One step's integer inputs, packed into one int32 buffer.

Packing means one host-to-device copy per step (from pinned memory on CUDA)
and, for CUDA graphs, fixed device addresses for every batch-size bucket:
the fixed part of the layout depends only on (tokens, sequences).

Block tables live on the device, one row per running sequence; a step
carries only the entries that changed since the sequence's last step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# src_rows[i] >= 0: token i is the one sampled into row src_rows[i] of the
# device-side sampled buffer by the previous step, which the host has not seen.
# sample_idx[k]: the token whose logits the k-th sampling sequence samples from.
# sample_seq_rows[k]: the device row of the k-th sampling sequence (its sampling words).
# seq_rows[s]: the device block-table row of sequence s.
# lora_slots[i]: the LoRA adapter slot token i's sequence runs with (core/lora.py), -1: none.
# window_step[0]: the window step a CUDA graph records its tokens at (it counts
# up on the device; each launch's copy resets it to 0).
FIELDS = ("input_ids", "src_rows", "positions", "block_idx", "offsets", "lora_slots",
          "context_lens", "query_start", "sample_idx", "sample_seq_rows", "seq_rows",
          "window_step")


def _sizes(n_tok: int, n_seq: int, n_upd: int) -> tuple[int, ...]:
    """Lengths of FIELDS, then of the block-table updates (indices, values)."""
    return (n_tok, n_tok, n_tok, n_tok, n_tok, n_tok, n_seq, n_seq + 1, n_seq, n_seq, n_seq, 1,
            n_upd, n_upd)


def fixed_size(n_tok: int, n_seq: int) -> int:
    return sum(_sizes(n_tok, n_seq, 0))


@dataclass
class PackedInputs:
    """Views of one packed buffer (numpy on the host side, torch on the device side)."""
    fields: dict
    n_tok: int
    n_seq: int
    n_upd: int = 0

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def total(self) -> int:
        return fixed_size(self.n_tok, self.n_seq) + 2 * self.n_upd


def views(buf, n_tok: int, n_seq: int, n_upd: int = 0) -> PackedInputs:
    fields, start = {}, 0
    for name, size in zip(FIELDS + ("table_idx", "table_val"), _sizes(n_tok, n_seq, n_upd)):
        fields[name] = buf[start:start + size]
        start += size
    return PackedInputs(fields, n_tok, n_seq, n_upd)


class TableRows:
    """Hands out device rows of per-sequence state (block-table entries, then
    sampling words from column ``words_at``); the last row is the padding row."""

    def __init__(self, num_rows: int, width: int, words_at: int):
        self.width = width
        self.words_at = words_at
        self.free = list(range(num_rows - 1, -1, -1))
        self.pad_row = num_rows

    def assign(self, seq) -> tuple[range, list[int]]:
        """Give ``seq`` a row; returns the updates that write its sampling words."""
        seq.row = self.free.pop()
        seq.synced = 0
        start = seq.row * self.width + self.words_at
        return range(start, start + len(seq.sample_words)), seq.sample_words

    def release(self, seq) -> None:
        if seq.row >= 0:
            self.free.append(seq.row)
            seq.row = -1


def fill(host: PackedInputs, seqs, num_tokens, block_size: int, rows: TableRows,
         scratch_block: int, steps: int = 1) -> tuple[list[int], list[int], list[int], bool]:
    """Write the step's inputs; padding rows after the real ones write to the
    scratch block. Returns (rows that sample, table entry indices, values,
    whether every sampling row is greedy).

    A sampling sequence's tokens (``steps`` of them in a decode window) are
    marked in flight (``pending``) at the slot of the sampled buffer they land
    in: the next step reads the last one from there. A sequence with a draft
    (core/speculation.py) computes its last token and the draft's, and samples
    from the last.
    The loop only appends to Python lists (cheap); numpy takes them in bulk.
    """
    ids, src, pos, bidx, ctx, seq_rows, sample_rows, lora = [], [], [], [], [], [], [], []
    upd_idx, upd_val = [], []
    greedy = True
    for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
        _row_updates(seq, rows, upd_idx, upd_val)
        table = seq.block_table
        start = seq.num_computed
        end = start + n
        if n == 1:
            # a token still in flight is read on the device from the sampled buffer
            pending = seq.pending
            ids.append(0 if pending else seq.token_ids[start])
            src.append(seq.sample_slot if pending else -1)
            pos.append(start)
            bidx.append(table[start // block_size])
            lora.append(seq.lora_slot)
        else:
            ids += seq.token_ids[start:end] if seq.draft is None else \
                seq.token_ids[start:] + seq.draft.tokens
            src += [-1] * n
            pos += range(start, end)
            bidx += [table[p // block_size] for p in range(start, end)]
            lora += [seq.lora_slot] * n
        ctx.append(end)
        seq_rows.append(seq.row)
        if end == len(seq.token_ids) + seq.pending or seq.draft is not None:
            seq.sample_slot = len(sample_rows)
            seq.pending += steps
            greedy = greedy and seq.params.temperature == 0
            sample_rows.append(i)
    t, s = len(ids), len(seqs)
    f = host.fields
    f["input_ids"][:t], f["src_rows"][:t], f["positions"][:t] = ids, src, pos
    f["block_idx"][:t], f["context_lens"][:s], f["seq_rows"][:s] = bidx, ctx, seq_rows
    f["lora_slots"][:t] = lora
    qs = f["query_start"]
    qs[0] = 0
    np.cumsum(num_tokens, out=qs[1:s + 1])
    _samplers(host, sample_rows, rows.pad_row)
    f["window_step"][0] = 0
    _pad(host, t, s, rows.pad_row, scratch_block)
    np.remainder(f["positions"], block_size, out=f["offsets"])
    return sample_rows, upd_idx, upd_val, greedy


def _row_updates(seq, rows: TableRows, upd_idx: list, upd_val: list) -> None:
    """Device-row writes a sequence needs: a row and its sampling words when it
    has none, and the block-table entries the device has not seen."""
    if seq.row < 0:
        idx, val = rows.assign(seq)
        upd_idx += idx
        upd_val += val
    table = seq.block_table
    if seq.synced < len(table):
        base = seq.row * rows.width
        upd_idx += range(base + seq.synced, base + len(table))
        upd_val += table[seq.synced:]
        seq.synced = len(table)


def _samplers(host: PackedInputs, sample_rows: list[int], pad_row: int) -> None:
    """Which token each sampling sequence samples from, and its device row. A
    graph samples every row it has: padding rows sample the last token, greedily."""
    n, f = len(sample_rows), host.fields
    f["sample_idx"][:n] = f["query_start"][1:][sample_rows] - 1
    f["sample_seq_rows"][:n] = f["seq_rows"][sample_rows]
    f["sample_idx"][n:] = host.n_tok - 1
    f["sample_seq_rows"][n:] = pad_row


def _pad(host: PackedInputs, t: int, s: int, pad_row: int, scratch_block: int) -> None:
    """Padding tokens and sequences up to the layout's (n_tok, n_seq): padding
    tokens sit at position 0 of the scratch block; padding sequences take them,
    one each while they last (a decode graph's padding rows) and the last
    sequence the rest (a mixed graph's padding, which then leaves sequences
    with no tokens at all; those attend to nothing)."""
    host.input_ids[t:] = 0
    host.src_rows[t:] = -1
    host.positions[t:] = 0
    host.block_idx[t:] = scratch_block
    host.lora_slots[t:] = -1
    host.seq_rows[s:] = pad_row
    pad_tokens, pad_seqs = host.n_tok - t, host.n_seq - s
    if pad_seqs:
        ends = np.minimum(np.arange(1, pad_seqs + 1), pad_tokens)
        ends[-1] = pad_tokens
        host.query_start[s + 1:] = t + ends
        np.subtract(host.query_start[s + 1:], host.query_start[s:-1], out=host.context_lens[s:])


def advance(inp: PackedInputs, tables: torch.Tensor, block_size: int,
            identity: torch.Tensor) -> None:
    """Turn a decode step's device inputs into the next window step's, on the
    device: every row moves one position on and reads the token it just
    sampled (in a decode batch row i samples into slot i). Padding rows stay
    on the padding table row, whose every entry is the scratch block. Tables
    have a spare last column, so a row past its last block reads the scratch
    block instead of running off the table."""
    inp.window_step += 1
    inp.positions += 1
    inp.context_lens += 1
    torch.remainder(inp.positions, block_size, out=inp.offsets)
    inp.block_idx.copy_(tables[inp.seq_rows, torch.div(inp.positions, block_size,
                                                       rounding_mode="floor")])
    inp.src_rows.copy_(identity[:inp.n_tok])


class InputStager:
    """Owns the packed host buffers (pinned on CUDA) and their device mirror.

    Host buffers alternate between steps: step n+1 is filled while step n's
    asynchronous copy may still be queued. Step n-1's copy, from the same
    buffer, is complete by then: the engine waited for step n-1's results.
    """

    def __init__(self, capacity: int, device: torch.device):
        pin = device.type == "cuda"
        self.host_t = [torch.zeros(capacity, dtype=torch.int32, pin_memory=pin)
                       for _ in range(2 if pin else 1)]
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=device) if pin else None
        self.turn = 0

    def host_views(self, n_tok, n_seq) -> PackedInputs:
        self.turn = (self.turn + 1) % len(self.host_t)
        return views(self.host_t[self.turn].numpy(), n_tok, n_seq)

    def add_updates(self, host: PackedInputs, idx: list[int], val: list[int]) -> PackedInputs:
        """Append block-table updates after the fixed fields."""
        host = views(self.host_t[self.turn].numpy(), host.n_tok, host.n_seq, len(idx))
        host.table_idx[:] = idx
        host.table_val[:] = val
        return host

    def packed(self, host: PackedInputs) -> np.ndarray:
        """The ints of ``host`` (the buffer's start), as one array."""
        return self.host_t[self.turn].numpy()[:host.total]

    def load(self, packed: np.ndarray, n_tok: int, n_seq: int, n_upd: int) -> PackedInputs:
        """Ints that ``packed`` gave on another rank, as this rank's host inputs. The
        buffer's previous copy (two orders ago) is complete: rank 0 sends an order only
        after step n-1's results came back, and its collectives needed this rank's
        step n-1, which ran after that copy."""
        self.turn = (self.turn + 1) % len(self.host_t)
        buf = self.host_t[self.turn].numpy()
        buf[:len(packed)] = packed
        return views(buf, n_tok, n_seq, n_upd)

    def to_device(self, host: PackedInputs) -> PackedInputs:
        src = self.host_t[self.turn]
        if self.dev is None:
            return views(src, host.n_tok, host.n_seq, host.n_upd)
        self.dev[:host.total].copy_(src[:host.total], non_blocking=True)
        return views(self.dev, host.n_tok, host.n_seq, host.n_upd)
