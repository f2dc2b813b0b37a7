"""One step's integer inputs, packed into one int32 buffer.

Packing means one host-to-device copy per step (from pinned memory on CUDA)
and, for CUDA graphs, fixed device addresses for every batch-size bucket:
the layout depends only on (tokens, sequences, block-table width).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# src_rows[i] >= 0: token i is the one sampled into row src_rows[i] of the
# device-side sampled buffer by the previous step, which the host has not seen.
# sample_idx[k]: the token whose logits the k-th sampling sequence samples from.
FIELDS = ("input_ids", "src_rows", "positions", "block_idx", "offsets", "context_lens",
          "query_start", "sample_idx", "block_tables")


def layout(n_tok: int, n_seq: int, width: int) -> dict[str, tuple[int, int]]:
    sizes = (n_tok, n_tok, n_tok, n_tok, n_tok, n_seq, n_seq + 1, n_seq, n_seq * width)
    spans, start = {}, 0
    for name, size in zip(FIELDS, sizes):
        spans[name] = (start, start + size)
        start += size
    return spans


@dataclass
class PackedInputs:
    """Views of one packed buffer (numpy on the host side, torch on the device side)."""
    fields: dict
    n_tok: int
    n_seq: int
    width: int
    total: int

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None


def views(buf, n_tok: int, n_seq: int, width: int) -> PackedInputs:
    spans = layout(n_tok, n_seq, width)
    fields = {name: buf[a:b] for name, (a, b) in spans.items()}
    fields["block_tables"] = fields["block_tables"].reshape(n_seq, width)
    return PackedInputs(fields, n_tok, n_seq, width, spans["block_tables"][1])


def fill(host: PackedInputs, seqs, num_tokens, block_size: int, scratch_block: int) -> list[int]:
    """Write the step's inputs (padding rows after the real ones point at the
    scratch block); returns the rows whose chunk reaches the end of their sequence."""
    ids, src, pos, ctx, qs, bt = (host.input_ids, host.src_rows, host.positions,
                                  host.context_lens, host.query_start, host.block_tables)
    bt.fill(scratch_block)
    src.fill(-1)
    sample_rows, t = [], 0
    qs[0] = 0
    for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
        start = seq.num_computed
        end = start + n
        if n == 1:
            if seq.pending:
                src[t] = seq.sample_slot
            else:
                ids[t] = seq.token_ids[start]
            pos[t] = start
        else:
            ids[t:t + n] = seq.token_ids[start:end]
            pos[t:t + n] = np.arange(start, end)
        table = seq.block_table
        bt[i, :len(table)] = table
        t += n
        qs[i + 1] = t
        ctx[i] = end
        if end == seq.num_scheduled_tokens:
            host.sample_idx[len(sample_rows)] = t - 1
            sample_rows.append(i)
    _pad(host, t, len(seqs))
    seq_of_token = np.repeat(np.arange(host.n_seq), np.diff(qs))
    host.block_idx[:] = bt[seq_of_token, pos // block_size]
    np.remainder(pos, block_size, out=host.offsets)
    return sample_rows


def _pad(host: PackedInputs, t: int, s: int) -> None:
    """Padding: one token per padded sequence, at position 0 of the scratch block."""
    host.input_ids[t:] = 0
    host.src_rows[t:] = -1
    host.positions[t:] = 0
    host.context_lens[s:] = 1
    host.query_start[s + 1:] = t + 1 + np.arange(host.n_seq - s)


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

    def host_views(self, n_tok, n_seq, width) -> PackedInputs:
        self.turn = (self.turn + 1) % len(self.host_t)
        return views(self.host_t[self.turn].numpy(), n_tok, n_seq, width)

    def to_device(self, host: PackedInputs) -> PackedInputs:
        src = self.host_t[self.turn]
        if self.dev is None:
            return views(src, host.n_tok, host.n_seq, host.width)
        self.dev[:host.total].copy_(src[:host.total], non_blocking=True)
        return views(self.dev, host.n_tok, host.n_seq, host.width)
