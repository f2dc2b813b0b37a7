"""The step kernels against the torch ops they replace (argmax, advance(), where)."""
import torch

from roseinfer.core.sample_kernel import BLOCK_V, WORDS, words
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.step_kernels import sample_advance, take_ids
from roseinfer.core.step_inputs import advance, fixed_size, views

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, SCRATCH = 4, 99


def decode_inputs(rows: int, gen: torch.Generator):
    """The packed buffer of a decode batch (row i = token i = sequence i) and its tables."""
    inp = views(torch.zeros(fixed_size(rows, rows), dtype=torch.int32), rows, rows)
    inp.positions[:] = torch.randint(0, 3 * BLOCK_SIZE, (rows,), generator=gen)
    inp.context_lens[:] = inp.positions + 1
    inp.offsets[:] = inp.positions % BLOCK_SIZE
    inp.seq_rows[:] = torch.randperm(rows, generator=gen)
    inp.src_rows[:] = -1
    inp.window_step[0] = 2
    state = torch.zeros(rows + 1, 5 + WORDS, dtype=torch.int32)  # greedy words: zeros
    tables = state[:, :5]
    tables[:] = torch.randint(0, 50, (rows + 1, 5), generator=gen, dtype=torch.int32)
    tables[:, -1] = SCRATCH  # the spare column
    inp.block_idx[:] = tables[inp.seq_rows.long(), (inp.positions // BLOCK_SIZE).long()]
    return inp.fields["input_ids"]._base.to(DEVICE), state.to(DEVICE)


def test_matches_argmax_and_advance():
    """Greedy rows: the argmax; a sampled row (temperature 1, top_k 1) too."""
    gen = torch.Generator().manual_seed(0)
    lane = int(BLOCK_V)  # the kernel's chunk: lane i reads i, i + lane, ...
    rows, vocab = 6, lane + lane // 2  # two chunks, the last one partial
    logits = torch.randn(rows, vocab + 24, generator=gen).half()[:, :vocab]  # padded head
    # Ties: the first index of the maximum wins, in one lane of two chunks
    # and across lanes.
    logits[0, [10, 10 + lane, lane // 2]] = logits[1, [2100, 2101]] = 50.0
    logits[2, vocab - 1] = 60.0
    logits = logits.to(DEVICE)
    buf, state = decode_inputs(rows, gen)
    inp, ref = views(buf, rows, rows), views(buf.clone(), rows, rows)
    top_k_one = words(SamplingParams(temperature=1.0, top_k=1, seed=7))
    state[inp.seq_rows[3].long(), 5:] = torch.tensor(top_k_one, dtype=torch.int32)
    window = torch.zeros(4, rows, dtype=torch.int32, device=DEVICE)
    sampled = torch.zeros(rows, dtype=torch.int32, device=DEVICE)

    sample_advance(logits, inp, state, 5, BLOCK_SIZE, sampled, window)

    expected = logits.argmax(dim=-1).to(torch.int32)
    assert expected[:3].tolist() == [10, 2100, vocab - 1]
    assert torch.equal(sampled, expected) and torch.equal(window[2], expected)
    assert not window[[0, 1, 3]].any()
    advance(ref, state[:, :5], BLOCK_SIZE, torch.arange(rows, dtype=torch.int32, device=DEVICE))
    for name, want in ref.fields.items():
        assert torch.equal(inp.fields[name], want), name


def test_take_ids_reads_sampled_slots_where_src_rows_say():
    gen = torch.Generator().manual_seed(1)
    n = 300  # more than one block of the kernel
    input_ids = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32)
    src_rows = torch.randint(-1, 8, (n,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(1000, 2000, (8,), generator=gen, dtype=torch.int32)
    expected = [int(sampled[s]) if s >= 0 else int(t) for t, s in zip(input_ids, src_rows)]
    for use_triton in (True, False):
        ids = take_ids(*(t.to(DEVICE) for t in (input_ids, src_rows, sampled)), use_triton=use_triton)
        assert ids.dtype == torch.int32 and ids.tolist() == expected
