"""Speculative decoding: greedy output equals decoding without drafts (and transformers),
and sampled output keeps the target's distribution (chi-square against the exact
distribution, computed from transformers' logits)."""
import random

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import ConfigError
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.plugins import PluginRegistry
from roseinfer.core.speculation import Draft
from tests.conftest import DEVICE
from tests.models import hf_greedy, tiny_llama

CONFIG = dict(device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8,
              num_speculative_tokens=4)
# chi-square tests reject at this p: a correct sampler fails about 1 run in 1,000 each
P_REJECT = 1e-3


class Oracle:
    """Proposes the reference continuation with one token in three replaced by a wrong
    one, so that rounds are kept whole, cut short and rejected at once."""
    references: dict = {}

    def __init__(self, ctx):
        self.vocab, self.rng = ctx.vocab_size, random.Random(0)

    def propose(self, token_ids, room):
        drafts = []
        for ids, n in zip(token_ids, room):
            prompt, ref = next(((p, r) for p, r in self.references.items()
                                if tuple(ids[:len(p)]) == p), (None, None))
            if ref is None:
                drafts.append(None)
                continue
            done = len(ids) - len(prompt)
            tokens = list(ref[done:done + n])
            for j in range(len(tokens)):
                if self.rng.random() < 1 / 3:
                    tokens[j] = (tokens[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            drafts.append(Draft(tokens) if tokens else None)
        return drafts


class FromQ:
    """Samples drafts from a fixed distribution q, and says so: rejection against q."""

    def __init__(self, ctx):
        g = torch.Generator().manual_seed(1)
        self.q = torch.softmax(torch.randn(ctx.vocab_size, generator=g) * 1.5, dim=0)
        self.device, self.gen = ctx.device, g

    def propose(self, token_ids, room):
        out = []
        for n in room:
            tokens = torch.multinomial(self.q, n, replacement=True, generator=self.gen)
            out.append(Draft(tokens.tolist(), self.q.expand(n, -1).to(self.device)))
        return out


class Fixed:
    """Always the same tokens, deterministically: rejection against a point mass."""

    def __init__(self, ctx):
        pass

    def propose(self, token_ids, room):
        return [Draft([3, 5, 2, 6][:n]) for n in room]


class Proposers:
    @hookimpl
    def roseinfer_register_proposers(self, register):
        register("oracle", Oracle)
        register("from_q", FromQ)
        register("fixed", Fixed)


def registry():
    plugins = PluginRegistry(load_entry_points=False)
    plugins.register(Proposers(), name="test-proposers")
    return plugins


def prompts_with_repeats(n, seed):
    """Random prompts whose second half repeats their first, so n-grams recur."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        half = [rng.randrange(2, 512) for _ in range(rng.randint(3, 9))]
        out.append(half + half)
    return out


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def test_prompt_lookup_proposes_what_followed_the_suffix():
    from roseinfer.plugins.speculative.ngram import Ngram

    drafts = Ngram(None).propose([
        [5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 6, 7],  # (6, 7) twice: the latest a whole draft follows
        [3, 4, 4, 4, 4, 4, 4, 4, 4],            # a loop: not the suffix shifted by one
        [1, 2, 3, 4],                           # nothing recurs
    ], [3, 2, 4])
    assert drafts[0].tokens == [8, 2, 6]
    assert drafts[1].tokens == [4, 4]
    assert drafts[2] is None


def test_ngram_greedy_equals_transformers():
    """A 16-token vocabulary: the model's greedy output repeats bigrams and longer runs
    often enough for prompt lookup to draft, and to be right some of the time."""
    model = tiny_llama(vocab=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 16) for _ in range(6)] for _ in range(6)]
    llm = LLM(model, speculative="ngram", **CONFIG)
    outs = llm.generate(prompts, greedy(40))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 40), prompt
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_rejected_drafts_leave_the_caches_consistent(llama_model, prefix_cache):
    """Rounds kept whole, cut short and rejected, crossing blocks of 4, with preemption
    (few blocks) and the prefix cache: a later request over the same prefix reads only
    blocks of accepted tokens."""
    prompts = prompts_with_repeats(5, seed=1)
    Oracle.references = {tuple(p): hf_greedy(llama_model, p, 60) for p in prompts}
    llm = LLM(llama_model, plugins=registry(), speculative="oracle",
              enable_prefix_cache=prefix_cache, **{**CONFIG, "num_kv_blocks": 48})
    outs = llm.generate(prompts, greedy(60))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == Oracle.references[tuple(prompt)], prompt
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    again = [p + r[:30] for p, r in zip(prompts, outs and
                                        [o.token_ids for o in outs])]
    for prompt, out in zip(again, llm.generate(again, greedy(10, speculative=False))):
        assert out.token_ids == hf_greedy(llama_model, prompt, 10)


def test_batches_mix_drafted_and_plain_rows(llama_model):
    """Rows that turn drafts off, and rows that need the logits pipeline (logprobs,
    penalties), run plainly beside drafted ones; every output is the plain one."""
    prompts = prompts_with_repeats(4, seed=2)
    Oracle.references = {tuple(p): hf_greedy(llama_model, p, 24) for p in prompts}
    params = [greedy(24), greedy(24, speculative=False), greedy(24, logprobs=2),
              greedy(24, repetition_penalty=1.3)]
    plain = LLM(llama_model, **CONFIG).generate(prompts, params)
    llm = LLM(llama_model, plugins=registry(), speculative="oracle", **CONFIG)
    outs = llm.generate(prompts, params)
    for a, b in zip(plain, outs):
        assert a.token_ids == b.token_ids
    assert [o.seq.spec is not None for o in outs] == [True, False, False, False]
    assert [lp.token_id for lp in outs[2].logprobs] == outs[2].token_ids
    assert [lp.logprob for lp in outs[2].logprobs] == \
        pytest.approx([lp.logprob for lp in plain[2].logprobs], abs=1e-4)


def test_draft_model_proposer(llama_model, tmp_path):
    """A draft model of the same vocabulary: the target's own weights (every draft
    kept) and a different model (drafts mostly rejected) both give the target's
    greedy output."""
    prompts = prompts_with_repeats(3, seed=3)
    same, other = tmp_path / "same", tmp_path / "other"
    llama_model.save_pretrained(same)
    torch.manual_seed(5)
    tiny_llama(num_hidden_layers=1).save_pretrained(other)
    torch.manual_seed(0)
    for draft, kept_all in ((same, True), (other, False)):
        llm = LLM(llama_model, speculative="draft", draft_model=str(draft), **CONFIG)
        for prompt, out in zip(prompts, llm.generate(prompts, greedy(20))):
            assert out.token_ids == hf_greedy(llama_model, prompt, 20)
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) == kept_all, stats


def test_refusals(llama_model):
    with pytest.raises(ConfigError, match="draft_model"):
        LLM(llama_model, speculative="draft", **CONFIG)
    with pytest.raises(ValueError, match="registered: draft, mtp, ngram"):
        LLM(llama_model, speculative="eagle", **CONFIG)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(llama_model, speculative="ngram", **{**CONFIG, "num_speculative_tokens": 0})


# ---- sampling keeps the target's distribution -----------------------------------

VOCAB, NEW = 8, 3
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_llama(vocab=VOCAB, initializer_range=0.05, eos_token_id=None)


def exact_marginals(hf, params: SamplingParams) -> torch.Tensor:
    """[NEW, VOCAB]: each new position's distribution, summed over every path to it,
    from transformers' logits with transformers' own temperature and top-k warpers."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    paths = {(): 1.0}
    marginals = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    for pos in range(NEW):
        grown = {}
        ids = torch.tensor([PROMPT + list(p) for p in paths])
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].double()
        for w in warpers:
            logits = w(ids, logits)
        probs = torch.softmax(logits, dim=-1)
        for (path, weight), row in zip(paths.items(), probs):
            marginals[pos] += weight * row
            for token in range(VOCAB):
                grown[path + (token,)] = weight * float(row[token])
        paths = grown
    return marginals


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value over the cells that can occur."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target rules out was sampled"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("proposer", ["fixed", "from_q"])
@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=1.5, top_k=5)])
def test_sampling_keeps_the_target_distribution(small_vocab_model, proposer, filters):
    """3,200 seeded samples of 3 tokens (200 requests, n=16): each position's empirical
    distribution against the exact one. The proposers draft deterministically (a point
    mass) and from a distribution q of their own, so both residual rules run."""
    params = [SamplingParams(n=16, seed=16 * i, max_tokens=NEW, ignore_eos=True, **filters)
              for i in range(200)]
    llm = LLM(small_vocab_model, plugins=registry(), speculative=proposer,
              speculative_disable_by_batch_size=4096,
              **{**CONFIG, "max_num_seqs": 256, "num_kv_blocks": 1024,
                 "num_speculative_tokens": 2})
    samples = [o.token_ids for group in llm.generate([PROMPT] * 200, params) for o in group]
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    counts = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    for tokens in samples:
        for pos, token in enumerate(tokens):
            counts[pos, token] += 1
    exact = exact_marginals(small_vocab_model, params[0])
    for pos in range(NEW):
        p = chi_square_p(counts[pos], exact[pos])
        assert p > P_REJECT, (pos, p, counts[pos].tolist(), exact[pos].tolist())
