"""Speculative decoding: a proposer guesses a sequence's next tokens, one target step
checks them all.

A sequence with a draft of d tokens computes d + 1 positions in one step: its last
token, then the draft. The logits at position j score draft token j; those at the
last position give the token after a fully accepted draft (the row's ordinary
sample). Acceptance is the standard rejection rule, which keeps the target's
distribution exactly: token x, proposed with probability q(x) (1 for a proposer that
picks deterministically), is kept with probability min(1, p(x) / q(x)), p being the
target's distribution after temperature, top-k, top-p and min-p, as a plain step
samples it. The first rejected position draws from max(0, p - q), renormalized, and
ends the round. Greedy rows keep draft tokens while they equal the target's argmax,
so their output is the output without speculation.

K/V rows of rejected tokens stay in their slots; ``num_computed`` moves back to the
last accepted token, so the next step writes over them and the prefix cache
publishes only blocks of accepted tokens.

The engine speculates in steps it collects at once (the next draft needs this
step's tokens), while few sequences run (``speculative_disable_by_batch_size``).
A request pauses its drafts once its rounds make tokens slower than plain steps
would, measured on this engine's own steps; each pause in a row is longer. Requests that need the logits
pipeline (penalties, logit bias, logprobs, structured output) and ones that ask
``speculative=False`` decode without drafts, beside drafted rows.

A proposer that drafts from the model's own final hidden states (``needs_hidden_states``:
DeepSeek-V3's MTP module) is handed, after every collected step, the positions each
sequence computed and kept and the model's hidden states there (``observe``), drafting
or not: its own cache then covers every position the model's does. Only eager steps
keep those states, so such a proposer runs without CUDA graphs or the compiled CPU step
(``decided``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import time

import torch

from roseinfer.core.config import turned_off
from roseinfer.core.request import Status
from roseinfer.core.sampler import Sampler

MIN_ROUNDS = 4       # rounds a request drafts before its gain is judged
EMA = 0.2            # weight of the newest sample in the running means
FIRST_PAUSE, MAX_PAUSE = 16, 512  # tokens a request decodes plainly after rounds lost


@dataclass
class Draft:
    """Proposed tokens, and the distribution each was drawn from ([d, vocab] on the
    engine's device; None: picked deterministically)."""
    tokens: list[int]
    probs: Optional[torch.Tensor] = None

    def first(self, n: int) -> Optional["Draft"]:
        """The first ``n`` tokens (None if none)."""
        if n <= 0:
            return None
        if n >= len(self.tokens):
            return self
        probs = self.probs[:n] if self.probs is not None else None
        return Draft(self.tokens[:n], probs)


@dataclass
class Target:
    """The model drafts are for: its spec (as the engine was given it), its module, its
    KV cache and its runner."""
    spec: object
    model: object
    kv_cache: object
    runner: object


@dataclass
class ProposerContext:
    """What a proposer factory gets: the engine's config, device, dtype, vocabulary
    size, plugins, k (the most tokens a draft may hold), the target's context, and the
    target itself."""
    config: object
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    plugins: object
    k: int
    max_model_len: int
    target: Optional[Target] = None


class SpecState:
    """One sequence's speculation record."""
    __slots__ = ("rounds", "tokens_per_round", "resume_at", "pause", "generator")

    def __init__(self):
        self.rounds = 0  # since it last resumed
        self.tokens_per_round: Optional[float] = None
        self.resume_at = 0  # the length at which it drafts again after a pause
        self.pause = FIRST_PAUSE
        self.generator = None  # seeded draws where the sequence has no generator (CUDA)


class Speculator:
    def __init__(self, proposer, k: int, max_batch: int, device: torch.device):
        self.proposer, self.k, self.max_batch, self.device = proposer, k, max_batch, device
        self.observes = getattr(proposer, "needs_hidden_states", False)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.plain_s: Optional[float] = None   # a step of decode rows alone
        self.verify_s: Optional[float] = None  # a step with drafts (no prefill)
        self._last: Optional[float] = None     # the end of the last step (tick)

    def wanted(self, running) -> bool:
        """Whether this step should speculate: few sequences run, one of them may draft."""
        return len(running) <= self.max_batch and any(self._may_draft(s) for s in running)

    @staticmethod
    def _may_draft(seq) -> bool:
        p = seq.params
        return p.speculative and not p.processed and (
            seq.spec is None or len(seq.token_ids) >= seq.spec.resume_at)

    def propose(self, running) -> None:
        """Drafts for the running sequences at a decode step (their tokens all known)."""
        seqs, room = [], []
        for seq in running:
            seq.draft = None  # one the scheduler could not fit last time
            left = seq.max_len - len(seq.token_ids) - 1  # the round's own token needs one
            if (self._may_draft(seq) and left > 0 and not seq.pending
                    and seq.num_computed == len(seq.token_ids) - 1):
                seqs.append(seq)
                room.append(min(self.k, left))
        if not seqs:
            return
        drafts = self.proposer.propose(seqs if self.observes else [s.token_ids for s in seqs],
                                       room)
        for seq, draft, n in zip(seqs, drafts, room):
            seq.draft = draft.first(n) if draft is not None else None
            if seq.draft is not None and seq.spec is None:
                seq.spec = SpecState()

    def observe(self, launched, ids: list[list[int]]) -> None:
        """Hand a hidden-state proposer what the collected step computed and kept (after
        ``verify``, ``ids`` the rows' kept tokens): each live sequence's first position,
        how many positions, and the model's final hidden states at them, in order. Only
        positions whose next token is known go: a sequence that finished or gave its
        blocks back since the launch goes without."""
        starts, hidden = launched.hidden
        batch = launched.batch
        flat = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        kept = {}
        if launched.verify is not None:
            slot = {r: k for k, r in enumerate(launched.rows)}
            kept = {i: len(ids[slot[i]]) for i in launched.verify[0].seq_index}
        n_tok, steps = sum(batch.num_tokens), batch.steps
        seqs, firsts, counts, index, at = [], [], [], [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            count = kept.get(i, n * steps)
            if seq.status is Status.RUNNING and len(seq.token_ids) > starts[i] + count:
                seqs.append(seq)
                firsts.append(starts[i])
                counts.append(count)
                # a window's step w holds each sequence's one row at w * n_tok
                index += [at + q if steps == 1 else q * n_tok + at for q in range(count)]
            at += n
        if seqs:
            rows = torch.tensor(index, dtype=torch.long, device=flat.device)
            self.proposer.observe(seqs, firsts, counts, flat[rows])

    @staticmethod
    def kind(batch) -> Optional[str]:
        """What a scheduled step times as: "plain" (decode rows alone), "verify"
        (drafts, no prefill chunk) or None (a prefill chunk, or nothing)."""
        if not batch.seqs or any(n > 1 and s.draft is None
                                 for s, n in zip(batch.seqs, batch.num_tokens)):
            return None
        return "verify" if batch.drafted else "plain"

    def tick(self, kind: Optional[str]) -> None:
        """The end of an engine step of ``kind``: the time since the last step's end is
        what this one cost, the caller's own work between steps and, for drafts, the
        proposer's included. Plain steps overlap their launch with the last step's
        collection, so this is their cost as served."""
        now = time.perf_counter()
        if kind is not None and self._last is not None:
            if kind == "verify":
                self.verify_s = _mean(self.verify_s, now - self._last)
            else:
                self.plain_s = _mean(self.plain_s, now - self._last)
        self._last = now if kind is not None else None

    def verify(self, launched, ids: list[list[int]]) -> None:
        """Replace each drafted row's sampled token (``ids``, by sampling row) by the
        tokens its round keeps, and move its ``num_computed`` back to them."""
        plan, logits = launched.verify
        batch_seqs, rows = launched.batch.seqs, launched.rows
        slot = {r: k for k, r in enumerate(rows)}
        kept = self._accept(plan, logits, [ids[slot[i]][0] for i in plan.seq_index])
        for i, tokens in zip(plan.seq_index, kept):
            seq = batch_seqs[i]
            d = len(seq.draft.tokens)
            seq.num_computed -= d - (len(tokens) - 1)
            self._record(seq, d, len(tokens) - 1)
            ids[slot[i]] = tokens
        for seq in batch_seqs:
            seq.draft = None

    def _accept(self, plan, logits, bonus: list[int]) -> list[list[int]]:
        """Each drafted sequence's kept draft tokens, then its next token."""
        out, at, argmax = [], 0, None
        for n, i in enumerate(plan.seq_index):
            seq = plan.seqs[i]
            d = len(seq.draft.tokens)
            if seq.params.greedy:
                if argmax is None:  # one copy to the host for every greedy row
                    argmax = logits.argmax(dim=-1).tolist()
                out.append(_greedy_round(seq.draft.tokens, argmax[at:at + d], bonus[n]))
            else:
                out.append(self._sampled_round(seq, seq.draft, logits[at:at + d], bonus[n]))
            at += d
        return out

    def _sampled_round(self, seq, draft: Draft, logits: torch.Tensor, bonus: int) -> list[int]:
        d = len(draft.tokens)
        p = Sampler.probs(logits, [seq.params] * d)
        p /= p.sum(dim=-1, keepdim=True)
        x = torch.tensor(draft.tokens, device=logits.device)
        at = torch.arange(d, device=logits.device)
        p_x = p[at, x]
        q_x = draft.probs[at, x].float() if draft.probs is not None else torch.ones_like(p_x)
        gen = self._generator(seq)
        u = torch.rand(d, device=logits.device, generator=gen)
        rejected = (u * q_x > p_x).tolist()  # kept with probability min(1, p / q)
        if True not in rejected:
            return draft.tokens + [bonus]
        j = rejected.index(True)
        if draft.probs is not None:
            residual = (p[j] - draft.probs[j].float()).clamp_(min=0)
        else:
            residual = p[j].clone()
            residual[draft.tokens[j]] = 0
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw of p is exact
            residual = p[j]
        token = int(torch.multinomial(residual, 1, generator=gen))
        return draft.tokens[:j] + [token]

    def _generator(self, seq) -> Optional[torch.Generator]:
        if seq.generator is not None or seq.params.seed is None:
            return seq.generator
        state = seq.spec
        if state.generator is None:
            state.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return state.generator

    def _record(self, seq, proposed: int, accepted: int) -> None:
        state = seq.spec
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        state.rounds += 1
        state.tokens_per_round = _mean(state.tokens_per_round, 1.0 + accepted)
        if state.rounds < MIN_ROUNDS or self.plain_s is None or self.verify_s is None:
            return
        if state.tokens_per_round * self.plain_s >= self.verify_s:
            state.pause = FIRST_PAUSE
            return
        # plain steps make its tokens faster for now: pause, longer each time in a row
        state.resume_at = len(seq.token_ids) + state.pause
        state.pause = min(2 * state.pause, MAX_PAUSE)
        state.rounds, state.tokens_per_round = 0, None


def _greedy_round(draft: list[int], target: list[int], bonus: int) -> list[int]:
    for j, (x, t) in enumerate(zip(draft, target)):
        if x != t:
            return draft[:j] + [t]
    return draft + [bonus]


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class VerifyPlan:
    """The drafted sequences of one step (their batch indices) and the step's token
    rows whose logits score their draft tokens."""

    def __init__(self, seqs, seq_index: list[int], row_list: list[int]):
        self.seqs, self.seq_index, self.row_list = seqs, seq_index, row_list

    @classmethod
    def of(cls, seqs, num_tokens) -> "VerifyPlan":
        index, rows, flat = [], [], 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            if seq.draft is not None:
                index.append(i)
                rows += range(flat, flat + n - 1)
            flat += n
        return cls(seqs, index, rows)


def draft_tokens(config, device: torch.device) -> int:
    """k: the most tokens a draft holds (config.py says why the default differs)."""
    k = config.num_speculative_tokens
    return k if k is not None else 8 if device.type == "cuda" else 4


def decided(cfg, plugins):
    """``cfg`` with CUDA graphs and the compiled CPU step off where the proposer reads the
    model's hidden states, which only eager steps keep (module doc)."""
    if cfg.speculative is None or not getattr(
            plugins.get("proposer", cfg.speculative).factory, "needs_hidden_states", False):
        return cfg
    return turned_off(cfg, f"the {cfg.speculative} proposer reads the model's hidden "
                      "states, which eager steps keep", {"cuda_graphs": False,
                                                          "cpu_compiled_step": "off"})


def beside(cfg, plugins, hf_config, dtype) -> tuple[int, int]:
    """(bytes of weights, KV layers over the model's blocks) that the proposer adds on the
    device after the model's cache is sized (its ``needs_memory``), which the sizing
    leaves room for."""
    if cfg.speculative is None:
        return 0, 0
    need = getattr(plugins.get("proposer", cfg.speculative).factory, "needs_memory", None)
    return need(cfg, hf_config, dtype, plugins) if need is not None else (0, 0)


def build(config, plugins, device, dtype, vocab_size, max_model_len,
          target: Optional[Target] = None) -> Optional[Speculator]:
    """The engine's speculator, if ``config.speculative`` names a proposer."""
    if config.speculative is None:
        return None
    k = draft_tokens(config, device)
    proposer = plugins.create("proposer", config.speculative,
                              ProposerContext(config, device, dtype, vocab_size, plugins, k,
                                              max_model_len, target))
    return Speculator(proposer, k, config.speculative_disable_by_batch_size, device)
