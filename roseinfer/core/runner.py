"""Builds one step's inputs, runs the model (eagerly or as a CUDA graph), samples.

Steps are launched without waiting: sampled ids stay on the device (the next
step reads decode inputs from there) and reach the host through an async copy,
so the host can finish step n-1's bookkeeping while the GPU runs step n.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from roseinfer.core import multimodal, tp
from roseinfer.core.attention import AttnMetadata, StepContext, set_context
from roseinfer.core.cuda_graphs import StepGraphs
from roseinfer.core.kv_cache import KVCache, SlotBatch
from roseinfer.core.logits import LogitsWork, PromptPlan, TokenLogprob, to_host
from roseinfer.core.processors import accept_early
from roseinfer.core.sample_kernel import WORDS, sample
from roseinfer.core.sampler import Sampler
from roseinfer.core.scheduler import ScheduledBatch
from roseinfer.core.speculation import VerifyPlan
from roseinfer.core.step_kernels import sample_advance, take_ids
from roseinfer.core.step_order import StepOrder
from roseinfer.core.step_inputs import (InputStager, PackedInputs, TableRows, advance, fill,
                                        fixed_size)


@dataclass
class LaunchedStep:
    batch: ScheduledBatch
    rows: list[int]                  # batch rows that sample a token
    tokens: torch.Tensor             # host [window step, row]: the sampled ids arrive here
    done: Optional[torch.cuda.Event]
    logprobs: Optional[list] = None  # LogitsWork.logprobs of each window step
    prompt: Optional[tuple] = None   # (PromptPlan, its device results), if any was due
    verify: Optional[tuple] = None   # (VerifyPlan, its draft positions' logits), if any
    started: float = 0.0             # core/step_times.py: when it was launched
    # (each sequence's first position, the final hidden states of each forward) where a
    # proposer reads them (keep_hidden; core/speculation.py ``observe``)
    hidden: Optional[tuple] = None
    ready: Optional[float] = None    # when its results were ready, if known at launch

    def result(self) -> list[list[int]]:
        """Each sampling row's ids, one per window step."""
        if self.done is not None:
            self.done.synchronize()
        return self.tokens[:self.batch.steps, :len(self.rows)].T.tolist()

    def token_logprobs(self, ids: list[list[int]],
                       tokenizer=None) -> dict[int, list[TokenLogprob]]:
        """Log probabilities by sampling row, one per window step, for the rows
        that asked (after result())."""
        out: dict[int, list[TokenLogprob]] = {}
        seqs = [self.batch.seqs[r] for r in self.rows]
        for step, found in enumerate(self.logprobs or []):
            for k, lp in to_host(found, seqs, [t[step] for t in ids], tokenizer).items():
                out.setdefault(k, []).append(lp)
        return out

    def prompt_logprobs(self, tokenizer=None) -> list[tuple[int, int, TokenLogprob]]:
        """(batch index, prompt position, TokenLogprob) computed by this step (after result())."""
        if self.prompt is None:
            return []
        plan, found = self.prompt
        return plan.to_host(found, tokenizer)


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, attention, device: torch.device,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 cuda_graphs: bool, decode_steps: int = 1, mixed_graph_tokens: int = 0,
                 peers=None, verify_graph_tokens: tuple[int, int] = (0, 0), lora: bool = False):
        self.model = model
        self.lora = lora  # the model's projections take LoRA adapters (layers/lora.py)
        self.peers = peers  # tp_workers.Peers: the other ranks, on rank 0 of a group
        self.copies: list[tuple[int, int]] = []  # KV blocks copied since the last order
        self.side_caches: list[KVCache] = []  # caches over the same blocks (a proposer's)
        self.keep_hidden = False  # a proposer reads the final hidden states (eager steps)
        self.hidden: list[torch.Tensor] = []  # this step's, one per forward
        self.snapshots = None  # recurrent states at block boundaries (core/state_snapshots.py)
        self.rope_shift = None  # a model with images: its rows' position offsets (multimodal)
        self.model_inputs = None  # the step's, beside ids and positions (StepContext)
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.block_size = kv_cache.block_size
        # One spare column (always the scratch block): see advance().
        self.max_blocks = -(-max_model_len // self.block_size) + 1
        self.max_model_len = max_model_len
        tokens = max(max_num_batched_tokens, max_num_seqs)
        # A sequence's device row: its block table, then its sampling words
        # (the padding row's are zeros: greedy).
        width = self.max_blocks + WORDS
        # Updates: at most every entry of every row, when all sequences are new, and each
        # other KV group's block for every block a step allocates: a block per block_size
        # tokens, and per sequence its last one, a copied one and its decode window's.
        # Mixed graphs have one sequence more than max_num_seqs (StepGraphs).
        new_blocks = tokens // self.block_size \
            + max_num_seqs * (decode_steps // self.block_size + 3)
        self.stager = InputStager(fixed_size(tokens, max_num_seqs + 1) + 2 * max_num_seqs * width
                                  + 2 * (len(kv_cache.groups) - 1) * new_blocks, device)
        self.rows = TableRows(max_num_seqs, width, self.max_blocks)
        # One buffer that step updates write into: the sequences' rows, then each KV group
        # g >= 1's block for every block of group 0 (core/kv_groups.py; scratch: none).
        rows_end = (max_num_seqs + 1) * width
        blocks = kv_cache.scratch_block + 1
        self.state = torch.full((rows_end + (len(kv_cache.groups) - 1) * blocks,),
                                kv_cache.scratch_block, dtype=torch.int32, device=device)
        self.seq_state = self.state[:rows_end].view(max_num_seqs + 1, width)
        self.seq_state[:, self.max_blocks:] = 0
        self.tables = self.seq_state[:, :self.max_blocks]
        self.group_blocks = self.state[rows_end:].view(-1, blocks) \
            if len(kv_cache.groups) > 1 else None
        self.remaps: tuple[list[int], list[int]] = ([], [])  # updates not yet sent
        self.sampler = Sampler()
        # Slots for every sequence of a mixed graph (one more than max_num_seqs).
        self.sampled = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.window = torch.zeros(decode_steps, max_num_seqs + 1, dtype=torch.int32, device=device)
        self.identity = torch.arange(max_num_seqs, dtype=torch.int32, device=device)
        # Two host landing buffers: step n's copy must not overwrite step n-1's ids.
        pin = device.type == "cuda"
        self.landing = [torch.zeros(decode_steps, max_num_seqs + 1, dtype=torch.int32, pin_memory=pin)
                        for _ in range(2)]
        self.launches = 0
        self.logits_work = LogitsWork(max_num_seqs + 1, model.head.vocab_size, device)
        self.graphs = None
        self.compiled = None  # core/cpu_step.py: a one-sequence decode step on the CPU
        self.mixed_graph_tokens = min(mixed_graph_tokens, tokens)
        self.verify_graph_tokens = verify_graph_tokens
        if cuda_graphs and device.type == "cuda":
            self.graphs = StepGraphs(self, max_num_seqs, decode_steps, self.mixed_graph_tokens,
                                     verify_graph_tokens)
            self.graphs.capture()

    def context(self, inp: PackedInputs, max_query_len: int, max_context_len: int,
                adapted: bool = True) -> StepContext:
        """``adapted``: some token may run with a LoRA adapter; without, the adapted
        projections launch only their base (layers/lora.py)."""
        offsets = inp.offsets
        slots = SlotBatch(inp.block_idx, offsets, shared_offset=offsets[:1])
        attn = AttnMetadata(None, inp.context_lens, inp.query_start,
                            max_query_len, max_context_len)
        return StepContext(self.kv_cache, self.attention, attn, slots,
                           lora_slots=inp.lora_slots if adapted else None)

    def adapted(self, host: PackedInputs) -> bool:
        """Whether a token of the step runs with a LoRA adapter (padding rows have none)."""
        return self.lora and bool((host.lora_slots >= 0).any())

    def remap(self, group: int, block: int, to: int) -> None:
        """KV group ``group``'s block for group 0's ``block`` is ``to`` from the next step
        on (BlockManager.remap)."""
        idx, val = self.remaps
        idx.append(self.seq_state.numel() + (group - 1) * self.group_blocks.shape[1] + block)
        val.append(to)

    def _add_remaps(self, upd_idx: list[int], upd_val: list[int]) -> None:
        """The remaps made since the last step join its table updates."""
        if self.remaps[0]:
            upd_idx += self.remaps[0]
            upd_val += self.remaps[1]
            self.remaps = ([], [])

    def forward(self, ctx: StepContext, inp: PackedInputs, logits_rows=None) -> torch.Tensor:
        """Model forward under ``ctx``; logits of ``logits_rows`` (all rows if None)."""
        ctx.attn.block_tables = self.tables[inp.seq_rows]
        ctx.seq_rows = inp.seq_rows  # recurrent layers' state rows (core/recurrent.py)
        ctx.model_inputs = self.model_inputs
        ctx.attn.visible = getattr(self.model_inputs, "visible", None)
        ctx.attn.memo.clear()  # a decode window runs several forwards under one context
        ctx.slots.memo.clear()
        if self.group_blocks is not None:
            ctx.remap_groups(self.group_blocks)
        ids = take_ids(inp.input_ids, inp.src_rows, self.sampled)
        self.kv_cache.begin_step(ctx.slots, tuple(slots for _, slots in ctx.groups))
        if self.compiled is not None and self.compiled.serves(ids.shape[0], ctx.attn):
            logits = self.compiled(ids, inp.positions, ctx.attn.block_tables,
                                   ctx.attn.max_context_len, ctx.slots)
            return logits if logits_rows is None else logits[logits_rows]
        set_context(ctx)
        try:
            hidden = self.model(ids, inp.positions)
        finally:
            set_context(None)
        if self.keep_hidden:
            self.hidden.append(hidden)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Launch the batch's step (or window of decode steps) without waiting for it;
        ``previous``: the step still in flight, whose tokens constrained rows need."""
        seqs, num_tokens = batch.seqs, batch.num_tokens
        n_tok, n_seq = sum(num_tokens), len(seqs)
        starts = [s.num_computed for s in seqs] if self.keep_hidden else None
        self.hidden = []
        processed = any(s.params.processed for s in seqs)
        # Constrained rows whose last token is in flight, at its column of previous's ids.
        early = [(s, s.sample_slot) for s in seqs if s.constraints and s.pending] \
            if processed else []
        plan = PromptPlan.of(seqs, num_tokens, self.device) if processed else None
        verify = VerifyPlan.of(seqs, num_tokens) if batch.drafted else None
        extra = (verify.row_list if verify else []) + (plan.row_list if plan else [])
        # a step computing an image prompt's tokens runs eagerly (core/multimodal.py)
        images = multimodal.step_inputs(seqs, num_tokens, self.device) \
            if self.rope_shift is not None else None
        layout = None if images is not None else \
            self._layout(n_tok, n_seq, verify, plan, processed)
        host = self.stager.host_views(*(layout[:2] if layout else (n_tok, n_seq)))
        fresh = [s for s in seqs if s.row < 0 and s.params.penalized] if processed else []
        rows, upd_idx, upd_val, greedy = fill(host, seqs, num_tokens, self.block_size,
                                              self.rows, self.kv_cache.scratch_block, batch.steps)
        for seq in fresh:
            self.logits_work.start(seq)
        self._state_rows(seqs)
        self._add_remaps(upd_idx, upd_val)
        if upd_idx:
            host = self.stager.add_updates(host, upd_idx, upd_val)
        # A graph samples and advances its inputs itself (capture_step,
        # capture_mixed), which is all a batch whose every row samples needs.
        replay = layout is not None and not processed and not layout.all_logits and \
            (layout.mixed or len(rows) == n_seq)
        order = StepOrder(self.stager.packed(host), host.n_tok, host.n_seq, host.n_upd, layout,
                          n_seq, len(rows), batch.steps, max(num_tokens), replay, self.copies,
                          extra)
        self.copies = []
        if self.peers is not None:
            self.peers.send(order)
        inp, run = self._inputs(order, host, self._rows(extra))
        if replay:
            return self._replayed(batch, rows)
        found, prompt, checked = [], None, None
        work = None
        if processed and rows:
            work = self.logits_work.batch([seqs[r] for r in rows], inp.sample_seq_rows[:len(rows)])
        for step in range(batch.steps):
            if step and layout is None:
                advance(inp, self.tables, self.block_size, self.identity)
            logits = self._run_step(run, step, images, seqs, num_tokens)
            if extra:  # drafts and prefill chunks: one step, no window
                logits, checked, prompt = self._split_extra(logits, len(rows), verify, plan)
            if not rows:
                continue
            if early:  # after the forward is queued: processors.py says why
                self._take_early(previous, early)
            if work is not None:
                logits = work.apply(logits)
            tokens = self._sample(batch, rows, logits, inp, greedy,
                                  layout is not None and not layout.all_logits)
            if work is not None:
                work.record(tokens)
                found.append(work.logprobs(logits, tokens))
            # In a decode graph the step sampled and advanced by itself; the ids
            # written here replace the ones it sampled, for the next step to read.
            self._record(step, tokens)
        launched = self._land(batch, rows, [f for f in found if f is not None] or None, prompt,
                              checked)
        if starts is not None:
            launched.hidden = (starts, self.hidden)
        return launched

    def _replayed(self, batch: ScheduledBatch, rows) -> LaunchedStep:
        """The batch's graph run: it samples and advances by itself. A recurrent model's
        graphs run one step, after which a block boundary's state snapshot is copied."""
        self.graphs.run_window(batch.steps)
        if self.snapshots is not None:
            self.snapshots.save(batch.seqs, batch.num_tokens, 0)
        return self._land(batch, rows)

    def _state_rows(self, seqs) -> None:
        """What the step's sequences carry on the device beside their tables, queued before
        its forward: recurrent states restored from snapshots, images' position offsets."""
        if self.snapshots is not None:
            self.snapshots.restore_rows(seqs)
        if self.rope_shift is not None:
            multimodal.shift_rows(self.rope_shift, seqs)

    def _run_step(self, run, step: int, images, seqs, num_tokens) -> torch.Tensor:
        """Window step ``step``'s logits, under the step's image inputs (a prompt's step:
        no window); then the recurrent states that end a block at it are kept."""
        self.model_inputs = images
        try:
            logits = run(step)
        finally:
            self.model_inputs = None
        if self.snapshots is not None:
            self.snapshots.save(seqs, num_tokens, step)
        return logits

    def _layout(self, n_tok: int, n_seq: int, verify, plan, processed: bool):
        """The captured layout the step runs in, or None (eager). Only verify graphs
        compute more than the sampling rows' logits; prompt log probabilities need an
        eager step."""
        if self.graphs is None:
            return None
        layout = self.graphs.layout(n_tok, n_seq, verify is not None and plan is None)
        if layout is not None and not layout.all_logits and \
                (verify or plan or (processed and layout.mixed)):
            return None
        return layout

    @staticmethod
    def _split_extra(logits, n_rows: int, verify, plan):
        """The sampling rows' logits, then (VerifyPlan, its draft rows' logits) and
        (PromptPlan, its device results), each None where the step has none."""
        logits, extra = logits[:n_rows], logits[n_rows:]
        drafted = len(verify.row_list) if verify else 0
        checked = (verify, extra[:drafted]) if verify else None
        prompt = (plan, plan.logprobs(extra[drafted:])) if plan is not None else None
        return logits, checked, prompt

    @torch.inference_mode()
    def follow(self, order: StepOrder) -> None:
        """Run rank 0's ``order`` on this rank of a tensor-parallel group: the same
        forwards (their collectives pair with rank 0's), with the ids rank 0
        sampled, received after each step."""
        host = self.stager.load(order.packed, order.n_tok, order.n_seq, order.n_upd)
        for src, dst in order.copies:
            self.kv_cache.copy_block(src, dst)
        inp, run = self._inputs(order, host, self._rows(order.extra_rows))
        if order.replay:
            self.graphs.run_window(order.steps)
            return
        for step in range(order.steps):
            if step and order.layout is None:
                advance(inp, self.tables, self.block_size, self.identity)
            run(step)
            if order.n_rows:
                self._share(order.n_rows)

    def _rows(self, rows: list[int]) -> Optional[torch.Tensor]:
        return torch.tensor(rows, dtype=torch.long).to(self.device) if rows else None

    def _inputs(self, order: StepOrder, host: PackedInputs, extra_rows):
        """Device inputs and the function that runs window step i (_eager)."""
        if order.layout is not None:
            return self.graphs.prepare(order.layout, host, order.real_seqs, order.n_rows,
                                       extra_rows)
        return self._eager(host, order.max_query_len, order.n_rows, extra_rows)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one KV block, here and (with the next order) on the other ranks."""
        for cache in (self.kv_cache, *self.side_caches):
            cache.copy_block(src, dst)
        if self.peers is not None:
            self.copies.append((src, dst))

    def _share(self, n: int) -> None:
        """Rank 0's sampled ids of the first ``n`` rows to every rank: the next
        step's inputs (rank 0 alone applies logits processors)."""
        if tp.group().size > 1:
            tp.broadcast(self.sampled[:n])

    @staticmethod
    def _take_early(previous: LaunchedStep, early) -> None:
        """The previous step's tokens of the constrained rows, to their states."""
        if previous.done is not None:
            previous.done.synchronize()
        tokens = previous.tokens[0].tolist()
        for seq, slot in early:
            accept_early(seq, tokens[slot])

    def _sample(self, batch, rows, logits, inp, greedy: bool, replayed: bool) -> torch.Tensor:
        """``replayed``: a decode graph ran the step and moved the positions on."""
        if self.device.type == "cuda":  # the graphs' sampler: same tokens either way
            return sample(logits, inp, self.seq_state, self.max_blocks, -1 if replayed else 0)
        if greedy:
            return logits.argmax(dim=-1)
        picked = [batch.seqs[r] for r in rows]
        return self.sampler(logits, [s.params for s in picked], [s.generator for s in picked])

    def _record(self, step, tokens: torch.Tensor) -> None:
        """Tokens into the sampled buffer (the next step's inputs) and the
        window (for the host); ``step`` is an int or a device tensor."""
        n = tokens.shape[0]
        tokens = tokens.to(torch.int32)  # indexing by a tensor does not cast
        self.sampled[:n] = tokens
        self.window[step, :n] = tokens
        self._share(n)

    def capture_step(self, ctx: StepContext, inp: PackedInputs) -> torch.Tensor:
        """What a decode CUDA graph holds: the forward, sampling of every
        row, and the inputs advanced for the next window step."""
        logits = self.forward(ctx, inp)
        sample_advance(logits, inp, self.seq_state, self.max_blocks, self.block_size,
                       self.sampled, self.window)
        self._share(logits.shape[0])
        return logits

    def capture_verify(self, ctx: StepContext, inp: PackedInputs) -> torch.Tensor:
        """What a verify CUDA graph holds: the forward and the logits of every token
        (draft positions score drafts; sampling happens after, from the last)."""
        return self.forward(ctx, inp)

    def capture_mixed(self, ctx: StepContext, inp: PackedInputs) -> None:
        """What a mixed-step CUDA graph holds: the forward and sampling of every
        sequence (padding ones sample greedily from a padding token; nothing
        reads their slots)."""
        logits = self.forward(ctx, inp, inp.sample_idx)
        self._record(0, sample(logits, inp, self.seq_state, self.max_blocks))

    def _land(self, batch, rows, logprobs=None, prompt=None, verify=None) -> LaunchedStep:
        """Start the window's ids on their way to the host. A step with none (a prompt's
        chunk) is waited for too: its inputs are copied from the host buffer that the
        step after next refills (InputStager), so that step may not be filled before
        this one ran."""
        landing = self.landing[self.launches % 2]
        self.launches += 1
        if rows or prompt is not None:
            landing[:batch.steps].copy_(self.window[:batch.steps], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(batch, rows, landing, done, logprobs, prompt, verify)

    def to_device(self, host: PackedInputs) -> PackedInputs:
        """Copy the packed inputs over and apply the block-table updates they carry."""
        inp = self.stager.to_device(host)
        if inp.n_upd:
            self.state[inp.table_idx.long()] = inp.table_val
        return inp

    def _eager(self, host: PackedInputs, max_query_len: int, num_samples: int,
               extra_rows: Optional[torch.Tensor] = None):
        """Device inputs, and a function that runs window step ``i`` on them: the
        sampling rows' logits, then those of ``extra_rows``."""
        shared = bool((host.offsets == host.offsets[0]).all())
        max_context_len = int(host.context_lens.max())
        inp = self.to_device(host)
        ctx = self.context(inp, max_query_len, max_context_len, self.adapted(host))
        if not shared:
            ctx.slots.shared_offset = None

        rows = inp.sample_idx[:num_samples]
        if extra_rows is not None:
            rows = torch.cat([rows.long(), extra_rows])

        def run(i: int) -> torch.Tensor:
            ctx.attn.max_context_len = max_context_len + i
            return self.forward(ctx, inp, rows)
        return inp, run
