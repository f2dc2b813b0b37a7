"""A step's bookkeeping around the model, in Triton: which ids go in, and the
end of a decode-graph step.

Each replaces a chain of small torch ops, and at decode batch sizes each
small kernel costs more in launch gap than in work.

``take_ids``: a token's id is its own, or (``src_rows >= 0``) the one the
previous step sampled into that slot of the sampled buffer: one kernel
instead of four.

``sample_advance``: a decode CUDA graph ends its step with each row's
token (argmax or sampled, sample_kernel), the id into the sampled buffer
(the next step's input) and into the window (for the host), and the inputs
advanced for the next window step (``step_inputs.advance``): about a dozen
torch kernels. Here it is one program per row, plus the window-step
counter's increment, which must wait until every row has read it.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch

from roseinfer.core.sample_kernel import SAMPLE, sample_row
from roseinfer.core.step_inputs import PackedInputs
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs

BLOCK_IDS = 256


@_kernel
def _take_ids_kernel(input_ids_ptr, src_rows_ptr, sampled_ptr, out_ptr, n, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    src = tl.load(src_rows_ptr + i, mask=ok, other=-1)
    own = tl.load(input_ids_ptr + i, mask=ok & (src < 0))
    sampled = tl.load(sampled_ptr + src, mask=ok & (src >= 0))
    tl.store(out_ptr + i, tl.where(src >= 0, sampled, own), mask=ok)


def take_ids(input_ids: torch.Tensor, src_rows: torch.Tensor, sampled: torch.Tensor,
             use_triton: bool | None = None) -> torch.Tensor:
    """``where(src_rows >= 0, sampled[src_rows], input_ids)``; Triton iff on
    CUDA unless ``use_triton`` says otherwise (on the CPU, interpreted)."""
    if not (input_ids.is_cuda if use_triton is None else use_triton):
        return torch.where(src_rows >= 0, sampled[src_rows.clamp(min=0)], input_ids)
    out = torch.empty_like(input_ids)
    n = input_ids.shape[0]
    pdl = dependent_launch(input_ids.device, n)
    _take_ids_kernel[(triton.cdiv(n, BLOCK_IDS),)](input_ids, src_rows, sampled, out, n,
                                                   BLOCK=BLOCK_IDS, PDL=pdl, launch_pdl=pdl)
    return out


@_kernel
def _sample_advance_kernel(
    logits_ptr, s_logits, vocab, sampled_ptr, window_ptr, s_window, window_step_ptr,
    positions_ptr, context_lens_ptr, offsets_ptr, block_idx_ptr, src_rows_ptr, seq_rows_ptr,
    state_ptr, s_state, words_at, block_size, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    # In a decode graph row i is token i and sequence i, and samples into slot i.
    state = state_ptr + tl.load(seq_rows_ptr + row).to(tl.int64) * s_state
    pos = tl.load(positions_ptr + row)
    token = sample_row(logits_ptr + row.to(tl.int64) * s_logits, vocab, state + words_at, pos)
    tl.store(sampled_ptr + row, token)
    tl.store(window_ptr + tl.load(window_step_ptr) * s_window + row, token)
    pos += 1
    tl.store(positions_ptr + row, pos)
    tl.store(context_lens_ptr + row, tl.load(context_lens_ptr + row) + 1)
    tl.store(offsets_ptr + row, pos % block_size)
    tl.store(block_idx_ptr + row, tl.load(state + pos // block_size))  # the table comes first
    tl.store(src_rows_ptr + row, row)


def sample_advance(logits: torch.Tensor, inp: PackedInputs, state: torch.Tensor, words_at: int,
                   block_size: int, sampled: torch.Tensor, window: torch.Tensor) -> None:
    """For a decode batch (row i = token i = sequence i): each row's token,
    sampled under its sequence's words in ``state`` (sample_kernel), into
    ``sampled`` and ``window[inp.window_step]``, then ``advance(inp)``.
    ``state`` holds each sequence's block table in its first columns."""
    rows = logits.shape[0]
    assert inp.n_tok == inp.n_seq == rows and logits.stride(1) == 1
    pdl = dependent_launch(logits.device, rows)
    _sample_advance_kernel[(rows,)](
        logits, logits.stride(0), logits.shape[1], sampled, window, window.stride(0),
        inp.window_step, inp.positions, inp.context_lens, inp.offsets, inp.block_idx,
        inp.src_rows, inp.seq_rows, state, state.stride(0), words_at, block_size, PDL=pdl,
        num_warps=SAMPLE["num_warps"], launch_pdl=pdl)
    inp.window_step += 1
