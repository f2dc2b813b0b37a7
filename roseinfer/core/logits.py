"""Work on the logits before sampling, for the requests that ask for it:
logit bias, repetition / frequency / presence penalties, logits processors
(core/processors.py), log probabilities.

Penalties count each sequence's tokens, the one of the step still in flight
included, which the host has not seen yet: so the counts live on the
device, one row per sequence row (as runner.seq_state), and each step adds
its samples there. They are allocated when the first penalized request
starts. A step with such a request samples after its CUDA graph (or eager
forward) instead of inside it; decode windows still apply, each of their
steps doing this work in turn. Steps without such requests are untouched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from roseinfer.core import processors


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # the most likely ids, most likely first
    tokenizer: object = None

    @property
    def texts(self) -> list[str] | None:
        """Each id's text alone (the token's, then the top ids'), if there is a
        tokenizer. Decoded on access, off the engine's step (the Redis worker
        reads it on its sender thread)."""
        if self.tokenizer is None:
            return None
        return [self.tokenizer.decode([t]) for t in [self.token_id, *(t for t, _ in self.top)]]


class LogitsWork:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab, self.device = num_rows, vocab_size, device
        self.counts: torch.Tensor | None = None   # int32 [rows, vocab]: generated occurrences
        self.seen: torch.Tensor | None = None     # bool [rows, vocab]: in prompt or output

    def start(self, seq) -> None:
        """Count a penalized sequence's tokens into its (new) device row."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.int32,
                                      device=self.device)
            self.seen = torch.zeros(self.num_rows, self.vocab, dtype=torch.bool, device=self.device)
        counts, seen = self.counts[seq.row], self.seen[seq.row]
        counts.zero_()
        seen.zero_()
        out = self._tensor(seq.output_ids)
        counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        seen[self._tensor(seq.token_ids)] = True

    def batch(self, seqs, rows: torch.Tensor) -> "BatchWork":
        """The work of one launch's sampling ``seqs`` (device rows ``rows``)."""
        return BatchWork(self, seqs, rows)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        """A small host list on the device without waiting for the GPU: a
        plain copy from pageable memory would wait for every queued step."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=pin)


class BatchWork:
    """One launch's logits work, its per-row parameters on the device: built
    once, used by every step of a decode window."""

    def __init__(self, work: LogitsWork, seqs, rows: torch.Tensor):
        self.work, self.seqs = work, seqs
        self.constrained = any(s.constraints for s in seqs)
        tensor = work._tensor
        pen = [i for i, s in enumerate(seqs) if s.params.penalized]
        self.pen = tensor(pen) if pen else None
        if pen:
            params = [seqs[i].params for i in pen]
            self.pen_rows = rows[self.pen].long()
            self.rep, self.freq, self.pres = (
                tensor([getattr(p, name) for p in params], torch.float32)[:, None]
                for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
            bias = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias.items()]
            self.bias = None
            if bias:
                i, t, b = zip(*bias)
                self.bias = (tensor(i), tensor(t)), tensor(b, torch.float32)
        self.want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if self.want:
            self.want_idx = tensor(self.want)
            self.temps = tensor([seqs[i].params.temperature or 1.0 for i in self.want],
                                torch.float32)[:, None]
            self.k = max(seqs[i].params.logprobs for i in self.want)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Bias, penalties and logits processors on ``logits`` [R, V]: new logits,
        or ``logits`` itself, changed in place by the processors if any."""
        if self.pen is not None:
            logits = self._penalize(logits)
        if self.constrained:
            processors.apply(logits, self.seqs)
        return logits

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        if self.bias is not None:
            index, values = self.bias
            logits.index_put_(index, values.to(logits.dtype), accumulate=True)
        counts, seen = self.work.counts[self.pen_rows], self.work.seen[self.pen_rows]
        part = logits[self.pen].float()
        part = torch.where(seen, torch.where(part > 0, part / self.rep, part * self.rep), part)
        part -= self.freq * counts + self.pres * (counts > 0)
        logits[self.pen] = part.to(logits.dtype)
        return logits

    def record(self, tokens: torch.Tensor) -> None:
        """This step's samples into the penalized sequences' counts."""
        if self.pen is None:
            return
        t = tokens[self.pen].long()
        self.work.counts.index_put_((self.pen_rows, t), torch.ones_like(t, dtype=torch.int32),
                                    accumulate=True)
        self.work.seen[self.pen_rows, t] = True

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor):
        """Device tensors for the rows that asked: (row indices, chosen log
        probabilities, top values, top ids), or None."""
        if not self.want:
            return None
        lp = torch.log_softmax(logits[self.want_idx].float() / self.temps, dim=-1)
        chosen = lp.gather(1, tokens[self.want_idx].long()[:, None]).squeeze(1)
        top_vals, top_ids = lp.topk(self.k, dim=-1) if self.k else (lp[:, :0], lp[:, :0].long())
        return self.want, chosen, top_vals, top_ids


class PromptPlan:
    """The prompt positions of one step whose log probabilities are due: the
    step's token rows that predict them, the prompt tokens they predict, and
    (sequence index, prompt position) for each. From the raw logits."""

    ROWS_AT_ONCE = 512  # float32 log_softmax of 512 rows x 128k vocab: 256 MB

    def __init__(self, seqs, rows, targets, where, device):
        self.seqs, self.where, self.row_list = seqs, where, rows
        self.targets = torch.tensor(targets, dtype=torch.long).to(device)[:, None]
        self.k = max(seqs[i].params.prompt_logprobs for i, _ in where)

    @classmethod
    def of(cls, seqs, num_tokens, device) -> "PromptPlan | None":
        """None when no sequence of the step has prompt positions due. A token at
        position p predicts p + 1; launched steps have not moved num_computed on yet."""
        rows, targets, where, flat = [], [], [], 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            if seq.prompt_logprobs_due:
                start = seq.num_computed
                first = max(start, len(seq.prompt_logprobs) - 1)  # recomputed: already there
                for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append(flat + p - start)
                    targets.append(seq.token_ids[p + 1])
                    where.append((i, p + 1))
            flat += n
        return cls(seqs, rows, targets, where, device) if rows else None

    def logprobs(self, logits: torch.Tensor):
        """(chosen, top values, top ids) device tensors for the planned rows' logits."""
        parts = []
        for at in range(0, logits.shape[0], self.ROWS_AT_ONCE):
            lp = torch.log_softmax(logits[at:at + self.ROWS_AT_ONCE].float(), dim=-1)
            chosen = lp.gather(1, self.targets[at:at + self.ROWS_AT_ONCE]).squeeze(1)
            parts.append((chosen, *lp.topk(self.k, dim=-1)))
        return tuple(torch.cat(p) for p in zip(*parts))

    def to_host(self, found, tokenizer=None) -> list[tuple[int, int, TokenLogprob]]:
        """(sequence index, prompt position, its TokenLogprob) per planned row."""
        chosen, top_vals, top_ids = (t.tolist() for t in found)
        out = []
        for j, (i, pos) in enumerate(self.where):
            k = self.seqs[i].params.prompt_logprobs
            token = self.seqs[i].token_ids[pos]
            out.append((i, pos, TokenLogprob(token, chosen[j],
                                             list(zip(top_ids[j][:k], top_vals[j][:k])),
                                             tokenizer)))
        return out


def to_host(found, seqs, tokens: list[int], tokenizer=None) -> dict[int, TokenLogprob]:
    """``LogitsWork.logprobs`` output as TokenLogprob per sampling row. Ids a logits
    processor ruled out (log probability -inf) are no alternatives: they are left out."""
    want, chosen, top_vals, top_ids = found
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    out = {}
    for j, i in enumerate(want):
        k = seqs[i].params.logprobs
        top = [(t, v) for t, v in zip(top_ids[j][:k], top_vals[j][:k]) if v != -math.inf]
        out[i] = TokenLogprob(tokens[i], chosen[j], top, tokenizer)
    return out
