"""The multi-token-prediction proposer (``speculative="mtp"``) on tiny DeepSeek-V3 and
GLM-4.5 checkpoints that hold an MTP layer after their last one, as the released ones do.

Greedy output equals transformers' (no speculation), and every draft equals the MTP
module computed independently: transformers' decoder layer of the family over the
model's final hidden states and the next tokens' embeddings, as the DeepSeek-V3 report
defines it. Half the rounds swap in the reference token, so kept drafts (several
positions handed to the module at once) are covered as well as rejected ones."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import ConfigError
from roseinfer.core.speculation import Draft
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_deepseek import tiny_deepseek, tiny_glm4_moe
from tests.test_greedy_equality import mixed_prompts

STEPS = 12


class Mtp(nn.Module):
    """The reference module: transformers' own decoder layer and norms."""

    def __init__(self, model):
        super().__init__()
        cfg = model.config
        layer_class = type(model.model.layers[-1])
        norm_class = type(model.model.norm)
        self.enorm = norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = layer_class(cfg, cfg.num_hidden_layers)
        self.norm = norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps)
        with torch.no_grad():
            for p in self.parameters():
                nn.init.normal_(p, std=0.2) if p.dim() > 1 else nn.init.uniform_(p, 0.5, 1.5)
            if hasattr(self.block.mlp, "gate"):
                torch.nn.init.normal_(self.block.mlp.gate.e_score_correction_bias, std=0.3)
        self.eval()

    def checkpoint(self, model) -> dict:
        """Its tensors as the checkpoint names them (``model.layers.{L}.``), the shared
        embedding and head copied in as DeepSeek-V3's release holds them."""
        at = f"model.layers.{model.config.num_hidden_layers}."
        sd = {at + k: v for k, v in self.block.state_dict().items()}
        for name in ("enorm", "hnorm", "eh_proj"):
            sd[f"{at}{name}.weight"] = getattr(self, name).weight
        sd[at + "shared_head.norm.weight"] = self.norm.weight
        sd[at + "shared_head.head.weight"] = model.lm_head.weight
        sd[at + "embed_tokens.weight"] = model.model.embed_tokens.weight
        return sd

    @torch.no_grad()
    def logits(self, model, ids: list[int]) -> torch.Tensor:
        """At each position i of ``ids`` but the last: the logits for token i + 2."""
        x = torch.tensor([ids])
        h = model.model(x).last_hidden_state[0, :-1]
        e = model.model.embed_tokens(x[0, 1:])
        h = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))[None]
        n = h.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(h, attention_mask=mask, position_ids=positions,
                         position_embeddings=model.model.rotary_emb(h, positions))
        out = out[0] if isinstance(out, tuple) else out
        return model.lm_head(self.norm(out))[0]


def saved(model, tmp_path):
    mtp = Mtp(model)
    sd = {**model.state_dict(), **mtp.checkpoint(model)}
    save_file({k: v.detach().clone() for k, v in sd.items()}, tmp_path / "model.safetensors")
    model.config.save_pretrained(tmp_path)
    return mtp


def watch(llm, references: dict, swap_every: int = 2):
    """Record each sequence's drafts (its length, the token) as the proposer makes them;
    every ``swap_every``-th round propose the reference token instead."""
    proposer, rounds = llm.engine.speculator.proposer, []
    propose = proposer.propose

    def wrapped(seqs, room):
        drafts = propose(seqs, room)
        for k, (seq, draft) in enumerate(zip(seqs, drafts)):
            if draft is None:
                continue
            prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
            rounds.append((prompt, len(seq.token_ids), draft.tokens[0]))
            ref = references[prompt]
            done = len(seq.token_ids) - len(prompt)
            if len(rounds) % swap_every == 0 and done < len(ref):
                drafts[k] = Draft([ref[done]])
        return drafts
    proposer.propose = wrapped
    return rounds


FAMILIES = {"deepseek_v3": tiny_deepseek, "glm4_moe": tiny_glm4_moe}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_and_each_draft_the_mtp_module(family, tmp_path):
    model = FAMILIES[family]()
    mtp = saved(model, tmp_path)
    shared = mixed_prompts(1, seed=5)[0] * 2
    prompts = mixed_prompts(4, seed=6) + [shared, shared + [7, 8, 9]]
    references = {tuple(p): hf_greedy(model, p, STEPS) for p in prompts}
    llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_seqs=8, speculative="mtp", enable_prefix_cache=True)
    rounds = watch(llm, references)
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == references[tuple(prompt)], prompt
    assert len(rounds) >= len(prompts) * STEPS // 3  # drafts every round or so
    logits = {p: mtp.logits(model, list(p) + references[p]) for p in references}
    for prompt, length, token in rounds:
        row = logits[prompt][length - 2]  # the position before the sequence's last token's
        assert row[token] >= row.max() - 1e-4, (prompt, length)
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens >= stats.num_drafts // 2 - 1  # the swapped-in rounds


def test_a_checkpoint_without_an_mtp_layer_says_what_to_use(tmp_path):
    model = tiny_deepseek(num_nextn_predict_layers=0)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no multi-token-prediction layer.*ngram"):
        LLM(str(tmp_path), device=DEVICE, dtype="float32", num_kv_blocks=64,
            speculative="mtp")


def test_mtp_drafts_one_token_a_round(tmp_path):
    model = tiny_deepseek()
    saved(model, tmp_path)
    with pytest.raises(ConfigError, match="one token a round"):
        LLM(str(tmp_path), device=DEVICE, dtype="float32", num_kv_blocks=64,
            speculative="mtp", num_speculative_tokens=3)
