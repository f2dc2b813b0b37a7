"""Steps with prefill chunks in captured layouts (core.cuda_graphs.StepGraphs).

On the CPU the graphs are stood in for by their steps run eagerly on the
captured inputs, so everything but the capture itself is checked: buckets,
padding tokens and sequences (step_inputs._pad), the Triton attention kernel
(interpreted) with empty padding sequences, sampling inside the step, and
the ids landing on the host. On CUDA the real graphs run the same workloads.
"""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.cuda_graphs import StepGraphs, token_buckets
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_greedy_equality import mixed_prompts


class StepsRunEagerly:
    """Stands in for a captured graph: replay runs the step on the capture's
    inputs, which alias the step's (one host buffer on the CPU), and copies what it
    returns to the tensor the capture returned, as a graph's output stays put."""

    def __init__(self, step, ctx, inp, steps, replays, out):
        self.args, self.steps, self.replays, self.out = (step, ctx, inp), steps, replays, out

    def replay(self):
        step, ctx, inp = self.args
        self.replays[step.__name__] += 1
        for _ in range(self.steps):
            result = step(ctx, inp)
        if self.out is not None:
            self.out.copy_(result)


class EagerStepGraphs(StepGraphs):
    def __init__(self, *args):
        super().__init__(*args)
        self.replays = {"capture_step": 0, "capture_mixed": 0, "capture_verify": 0}

    def _graph(self, step, ctx, inp, steps):
        # Run as a replay runs: from window step 0, as the step's inputs load it (the
        # warm-up left it at 1, past a one-step window's last row).
        inp.window_step.zero_()
        out = step(ctx, inp)
        out = out.clone() if isinstance(out, torch.Tensor) else None
        return StepsRunEagerly(step, ctx, inp, steps, self.replays, out), out


def llm_with_graphs(model, monkeypatch, **config):
    config = {"device": DEVICE, "dtype": "float32", "block_size": 4, "num_kv_blocks": 256,
              "max_num_seqs": 8, "attention_backend": "triton_paged", **config}
    llm = LLM(model, **config)
    if DEVICE == "cpu":
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        runner, cfg = llm.engine.runner, llm.engine.config
        runner.graphs = EagerStepGraphs(runner, cfg.max_num_seqs, cfg.decode_steps,
                                        runner.mixed_graph_tokens, runner.verify_graph_tokens)
        runner.graphs.capture()
    return llm


def test_token_buckets():
    assert token_buckets(0) == []
    assert token_buckets(40) == [40]
    sizes = token_buckets(4096)
    assert sizes[:3] == [64, 128, 192] and sizes[-1] == 4096
    assert all(b - a <= max(64, a // 4) for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_mixed_steps_in_graphs_equal_transformers(family, request, monkeypatch):
    """Chunked prefill (at most 16 tokens a step) keeps prompts in prefill while
    others decode, so most steps are mixed and padded to the 16-token bucket."""
    hf = request.getfixturevalue(f"{family}_model")
    prompts = mixed_prompts(7, seed=5)
    llm = llm_with_graphs(hf, monkeypatch, max_num_batched_tokens=16, decode_steps=4,
                          decode_steps_min_seqs=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10), prompt
    graphs = llm.engine.runner.graphs
    assert graphs.token_sizes == [16]
    if DEVICE == "cpu":
        assert graphs.replays["capture_mixed"] >= 3 and graphs.replays["capture_step"] >= 1


def test_steps_too_large_for_a_bucket_run_eagerly(gpt2_model, monkeypatch):
    """The first step (120 prompt tokens) is past the largest bucket (100): it
    runs eagerly; the next ones are mixed graphs. Also: a padding sequence
    longer than a block table covers (the capture's dummy step puts 92 tokens
    on one; tables cover 52) reads no keys past it."""
    llm = llm_with_graphs(gpt2_model, monkeypatch, max_num_batched_tokens=128,
                          mixed_graph_max_tokens=100, max_model_len=48)
    graphs = llm.engine.runner.graphs
    assert graphs.layout(101, 4) is None
    assert graphs.layout(100, 4) == (100, 9, True, False)
    assert graphs.layout(3, 3) == (4, 4, False, False)
    prompts = [list(range(3 + i, 43 + i)) for i in range(3)] + [list(range(100, 120))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(gpt2_model, p, 6) for p in prompts]
    if DEVICE == "cpu":
        assert graphs.replays["capture_mixed"] >= 1


def test_seeded_sampling_in_mixed_graphs_matches_eager_steps(gpt2_model, monkeypatch):
    """A seeded request draws the same tokens whether its steps are mixed graphs
    or eager (the GPU sampler is keyed by seed and position, not by batch)."""
    if DEVICE == "cpu":
        pytest.skip("the CPU's eager steps sample with torch generators, not the GPU sampler")
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    prompts = mixed_prompts(6, seed=7)

    def run(**config):
        llm = llm_with_graphs(gpt2_model, monkeypatch, max_num_batched_tokens=16, **config)
        return [o.token_ids for o in llm.generate(prompts, params)]
    assert run() == run(mixed_graph_max_tokens=0)


def test_verify_steps_in_graphs(llama_model, monkeypatch):
    """Steps that check drafts replay verify graphs (every token's logits, padded to
    a bucket of 4, 8 or 16 tokens) beside plain rows; greedy ids equal transformers'."""
    from tests.test_speculative import Oracle, prompts_with_repeats, registry

    prompts = prompts_with_repeats(3, seed=4)
    Oracle.references = {tuple(p): hf_greedy(llama_model, p, 24) for p in prompts}
    llm = llm_with_graphs(llama_model, monkeypatch, plugins=registry(), speculative="oracle",
                          num_speculative_tokens=3, speculative_disable_by_batch_size=4,
                          max_num_batched_tokens=32)
    graphs = llm.engine.runner.graphs
    assert graphs.verify_sizes == [4, 8, 16]  # 1, 2 and 4 sequences of k + 1 = 4
    assert graphs.layout(9, 3, verify=True) == (16, 9, True, True)
    assert graphs.layout(4, 1, verify=True) == (4, 9, True, True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == Oracle.references[tuple(prompt)], prompt
    assert 0 < llm.engine.stats().num_accepted_tokens
    if DEVICE == "cpu":
        assert graphs.replays["capture_verify"] >= 3
