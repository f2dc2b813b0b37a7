"""The GPU sampler (sample_kernel) against the exact filtered distribution,
and its noise as a function of (seed, position) only. On the CPU it runs
under Triton's interpreter, which is slow per row: the CPU sample sizes are
small and the bounds wide (5 sigma); on CUDA they are large."""
import pytest
import torch

from roseinfer.core.sample_kernel import WORDS, sample, words
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.step_inputs import fixed_size, views

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ROWS = 200_000 if CUDA else 400
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -6.0])


def run(logits, params, positions):
    """Row k of ``logits`` sampled under ``params[k]`` at ``positions[k]``."""
    n = logits.shape[0]
    state = torch.zeros(n + 1, 3 + WORDS, dtype=torch.int32)  # 3 table columns, unused
    state[:n, 3:] = torch.tensor([words(p) for p in params], dtype=torch.int32)
    inp = views(torch.zeros(fixed_size(n, n), dtype=torch.int32), n, n)
    inp.sample_seq_rows[:] = torch.arange(n)
    inp.sample_idx[:] = torch.arange(n)
    inp.positions[:] = torch.tensor(positions)
    inp = views(inp.fields["input_ids"]._base.to(DEVICE), n, n)
    return sample(logits.to(DEVICE), inp, state.to(DEVICE), 3).cpu()


def expected(temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution after temperature, top-k, top-p and min-p, computed directly."""
    probs = torch.softmax(LOGITS / temperature, dim=-1)  # LOGITS is sorted, descending
    keep = torch.ones(len(probs), dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    keep &= (probs.cumsum(0) - probs) < top_p
    keep &= probs >= min_p * probs[0]
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize("filters", [
    dict(temperature=0.7),
    dict(temperature=0.5, top_p=0.9),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_frequencies_follow_the_filtered_distribution(filters):
    params = [SamplingParams(seed=s, **filters) for s in range(ROWS)]
    picks = run(LOGITS.repeat(ROWS, 1), params, [9] * ROWS)
    freq = torch.bincount(picks.long(), minlength=len(LOGITS)).double() / ROWS
    want = expected(**filters).double()
    sigma = (want * (1 - want) / ROWS).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq, want)
    assert (freq[want == 0] == 0).all()


def test_greedy_and_sampled_rows_share_a_batch():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 3
    picks = run(logits, params, [4] * 6)
    argmax = logits.argmax(dim=-1)
    assert picks[::2].tolist() == argmax[::2].tolist()
    assert picks[1::2].tolist() != argmax[1::2].tolist()  # 3000 near-flat tokens: never all argmax


def test_a_seeded_row_draws_the_same_token_wherever_it_sits():
    """The noise is a function of (seed, position, column): neighbours, row
    order and batch size do not change a seeded row's draws."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 500, generator=gen)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i) for i in range(8)]
    positions = list(range(20, 28))
    alone = [int(run(logits[i:i + 1], params[i:i + 1], positions[i:i + 1])[0]) for i in range(8)]
    order = torch.randperm(8, generator=gen).tolist()
    shuffled = run(logits[order], [params[i] for i in order], [positions[i] for i in order])
    assert [alone[i] for i in order] == shuffled.tolist()
    assert len(set(alone)) > 1
    # Another position is another draw: over 8 rows, some token changes.
    moved = run(logits, params, [p + 1 for p in positions])
    assert moved.tolist() != alone
