"""Work on the logits before sampling, for the requests that ask for it:
logit bias, repetition / frequency / presence penalties, log probabilities.

Penalties count each sequence's tokens, the one of the step still in flight
included, which the host has not seen yet: so the counts live on the
device, one row per sequence row (as runner.seq_state), and each step adds
its samples there. They are allocated when the first penalized request
starts. A step with such a request samples after its CUDA graph (or eager
forward) instead of inside it; decode windows still apply, each of their
steps doing this work in turn. Steps without such requests are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def apply(self, logits: torch.Tensor, seqs, rows: torch.Tensor) -> torch.Tensor:
        """Bias and penalties on ``logits`` [R, V] of the sampling ``seqs``
        (device rows ``rows``); returns new logits, or ``logits`` itself when
        no row asks for either."""
        bias = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias.items()]
        pen = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not pen:
            return logits
        logits = logits.clone()
        if bias:
            i, t, b = zip(*bias)
            logits.index_put_((self._tensor(i), self._tensor(t)),
                              self._tensor(b, logits.dtype), accumulate=True)
        if self.counts is not None:
            idx = self._tensor(pen)
            params = [seqs[i].params for i in pen]
            rep = self._tensor([p.repetition_penalty for p in params], torch.float32)[:, None]
            freq = self._tensor([p.frequency_penalty for p in params], torch.float32)[:, None]
            pres = self._tensor([p.presence_penalty for p in params], torch.float32)[:, None]
            counts, seen = self.counts[rows[idx].long()], self.seen[rows[idx].long()]
            part = logits[idx].float()
            part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
            part -= freq * counts + pres * (counts > 0)
            logits[idx] = part.to(logits.dtype)
        return logits

    def record(self, tokens: torch.Tensor, seqs, rows: torch.Tensor) -> None:
        """This step's samples into the penalized sequences' counts."""
        pen = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not pen or self.counts is None:
            return
        idx = self._tensor(pen)
        r, t = rows[idx].long(), tokens[idx].long()
        self.counts.index_put_((r, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)
        self.seen[r, t] = True

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, seqs):
        """Device tensors for the rows that asked: (row indices, chosen log
        probabilities, top values, top ids), or None."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not want:
            return None
        idx = self._tensor(want)
        temps = self._tensor([seqs[i].params.temperature or 1.0 for i in want], torch.float32)
        lp = torch.log_softmax(logits[idx].float() / temps[:, None], dim=-1)
        chosen = lp.gather(1, tokens[idx].long()[:, None]).squeeze(1)
        k = max(seqs[i].params.logprobs for i in want)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        return want, chosen, top_vals, top_ids

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        """A small host list on the device without waiting for the GPU: a
        plain copy from pageable memory would wait for every queued step."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=pin)


def to_host(found, seqs, tokens: list[int], tokenizer=None) -> dict[int, TokenLogprob]:
    """``LogitsWork.logprobs`` output as TokenLogprob per sampling row."""
    want, chosen, top_vals, top_ids = found
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    out = {}
    for j, i in enumerate(want):
        k = seqs[i].params.logprobs
        out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_ids[j][:k], top_vals[j][:k])),
                              tokenizer)
    return out
