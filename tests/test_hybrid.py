"""Hybrid models: Granite 4.0-H's Mamba2 layers beside attention ones (models/
granite_hybrid.py), each sequence's recurrent state in the state cache (core/recurrent.py),
against transformers' own model on tiny random configs: greedy ids equal for a batch of
mixed lengths, with prompts in chunks, with samples of one request, under preemption,
through prefix-cache hits that restore a state kept at a block boundary (and without one,
recomputed); and what a recurrent state cannot serve yet, turned off or refused."""
import inspect

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import ConfigError
from roseinfer.core.triton_support import triton_usable
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_mixed_graphs import llm_with_graphs
from tests.test_greedy_equality import check, mixed_prompts


def tiny_granite_hybrid(**overrides):
    """Mamba2, attention, Mamba2 (8 heads of 8 over 2 groups, a 4-tap convolution, state 16),
    experts of 48 (8, top 2) beside a shared MLP of 96."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(**{
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 48,
        "shared_intermediate_size": 96, "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
        "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16,
        "position_embedding_type": "rope", "max_position_embeddings": 256,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
        "logits_scaling": 2.0, "initializer_range": 0.2, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **overrides})
    return spread(GraniteMoeHybridForCausalLM(config).eval(), router="router")


def spread(model, router: str | None = None):
    """Weights that start at constants drawn apart, so that they matter: routers (else
    every expert ties), Mamba2's dt biases, D and A, and the norms."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if router is not None and router in name:
                torch.nn.init.normal_(p, std=0.5)
            elif name.endswith(("dt_bias", "D")):
                p.uniform_(-0.5, 1.0)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("overrides", [
    {}, {"num_local_experts": 0}, {"position_embedding_type": "nope"},
    {"mamba_n_groups": 1, "tie_word_embeddings": True}],
    ids=["moe", "dense", "nope", "one-group-tied"])
def test_greedy_equals_transformers(overrides):
    """A batch of mixed lengths (prompts longer than a 64-token SSM chunk among them)."""
    prompts = mixed_prompts(5, seed=7) + [list(range(5, 80))]
    check(tiny_granite_hybrid(**overrides), prompts, max_tokens=16)


def test_prompts_in_chunks_and_decode_windows_carry_the_state():
    """Chunked prefill (7 tokens a step, prompts cut mid-way) and a mixed step carry each
    sequence's convolution inputs and SSM state from chunk to chunk."""
    check(tiny_granite_hybrid(), mixed_prompts(4, seed=8) + [list(range(9, 60))],
          max_tokens=10, max_num_batched_tokens=7, max_mixed_prefill_tokens=7)


def test_preempted_sequences_recompute_their_state():
    """Too few blocks for all at once: sequences are preempted and recomputed from position
    0, their state rows handed to others in between."""
    llm = check(tiny_granite_hybrid(), mixed_prompts(6, seed=9), max_tokens=24,
                num_kv_blocks=14, max_num_seqs=4)
    assert llm.engine.stats().num_preemptions > 0


def test_samples_of_one_request_each_compute_their_prompt():
    hf = tiny_granite_hybrid()
    prompt = list(range(3, 40))
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128) as llm:
        assert not llm.engine.shares_prompts
        samples = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0,
                                                        ignore_eos=True))[0]
    assert [s.token_ids for s in samples] == [hf_greedy(hf, prompt, 8)] * 3


@pytest.mark.parametrize("family", ["granite", "qwen3_next"])
def test_a_one_token_prompt_joining_decode_steps_starts_from_zeros(family):
    """One-token prompts admitted while another sequence decodes: their first step is a
    decode step (all rows one token), where they start from zeros by a mask on the device,
    on a state row that a finished sequence left behind."""
    hf = tiny_granite_hybrid() if family == "granite" else tiny_qwen3_next()
    long_prompt, params = list(range(3, 30)), SamplingParams(max_tokens=10, temperature=0,
                                                             ignore_eos=True)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128,
             max_num_seqs=2, enable_prefix_cache=False) as llm:
        engine, ids = llm.engine, {}
        engine.add_request("dirty", [9], params)  # leaves its state in a row
        engine.add_request("long", long_prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.request_id == "dirty" and out.finished:
                    engine.add_request("one", [9], params)
    assert ids["one"] == ids["dirty"] == hf_greedy(hf, [9], 10)
    assert ids["long"] == hf_greedy(hf, long_prompt, 10)


def greedy_run(llm, hf, prompt, max_tokens=12):
    """One request through ``llm``: its output, checked against transformers'."""
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, max_tokens), prompt
    return out


@pytest.mark.parametrize("family", ["granite", "qwen3_next"])
def test_a_prefix_hit_restores_the_state_at_its_last_block(family):
    """A second prompt sharing the first's 37 tokens hits its blocks up to the first's last
    full block (36 tokens, the snapshot taken there: the first prompt's chunk made to end
    at it) and goes on from the restored state, token-exact."""
    hf = tiny_granite_hybrid() if family == "granite" else tiny_qwen3_next()
    shared = list(range(3, 40))
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128) as llm:
        assert llm.engine.config.enable_prefix_cache
        assert greedy_run(llm, hf, shared).num_cached_tokens == 0
        out = greedy_run(llm, hf, shared + [50, 51, 52, 53, 54, 55])
        assert out.num_cached_tokens == 36


def test_a_second_turn_hits_the_reply_up_to_its_last_block():
    """A conversation's next turn (the first prompt, its reply, a new message) hits the
    latest block boundary the first sequence decoded past: 10 + 21 computed tokens, so 28."""
    hf = tiny_qwen3_next()
    first = list(range(7, 17))
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128) as llm:
        reply = greedy_run(llm, hf, first, max_tokens=22).token_ids
        out = greedy_run(llm, hf, first + reply + [60, 61, 62])
        assert out.num_cached_tokens == 28


@pytest.mark.parametrize("family", ["granite", "qwen3_next"])
def test_decode_steps_run_as_graphs_and_keep_their_snapshots(family, monkeypatch):
    """Decode steps in captured layouts (on the CPU the steps stand in for the graphs,
    tests/test_mixed_graphs.py): a batch padded to its bucket (padding rows on the padding
    row, starting from zeros), token-exact; prompt steps eager. A second turn then hits the
    snapshot a replayed decode step kept at the reply's last block."""
    hf = tiny_granite_hybrid() if family == "granite" else tiny_qwen3_next()
    prompts = mixed_prompts(3, seed=13)
    llm = llm_with_graphs(hf, monkeypatch)
    assert llm.engine.runner.mixed_graph_tokens == 0
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
    first = list(range(7, 17))
    reply = greedy_run(llm, hf, first, max_tokens=22).token_ids
    assert greedy_run(llm, hf, first + reply + [60, 61, 62]).num_cached_tokens == 28
    if DEVICE == "cpu":
        assert llm.engine.runner.graphs.replays["capture_step"] >= 20


def test_a_prefix_without_its_snapshot_is_computed_again():
    """One snapshot row (max_num_seqs 1): a second prompt's snapshot takes the first's row,
    so the first prompt's blocks are still cached but its state is not. Asked again, it is
    computed from its start (no hit at all), never from a state its tokens did not make;
    that run keeps its snapshot again, and the next prompt sharing it hits."""
    hf = tiny_granite_hybrid()
    first, other = list(range(3, 30)), list(range(100, 127))
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128,
             max_num_seqs=1) as llm:
        greedy_run(llm, hf, first, max_tokens=1)
        greedy_run(llm, hf, other, max_tokens=1)
        assert llm.engine.blocks.cached_tokens(first + [5]) == 0
        assert greedy_run(llm, hf, first + [5], max_tokens=1).num_cached_tokens == 0
        assert greedy_run(llm, hf, first + [6]).num_cached_tokens == 24


def test_speculative_decoding_is_refused():
    with pytest.raises(ConfigError, match="without speculative"):
        LLM(tiny_granite_hybrid(), device=DEVICE, dtype="float32", speculative="ngram")


def tiny_qwen3_next(**overrides):
    """Gated DeltaNet, DeltaNet, gated attention, DeltaNet (2 key heads of 8 serving 4
    value heads of 6, a 4-tap convolution); experts of 24 (8, top 2) beside a gated shared
    expert of 40, the second layer dense; partial rotary (0.5)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(**{
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "full_attention",
                        "linear_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40, "mlp_only_layers": [1],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5},
        "max_position_embeddings": 256, "initializer_range": 0.2, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **overrides})
    torch_reference_kernels()
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a router starts at 0: every expert would tie
                torch.nn.init.normal_(p, std=0.5)
            elif name.endswith(("dt_bias", "A_log")):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name:  # offsets from one, as Gemma's
                p.uniform_(-0.5, 0.5)
    return model


def torch_reference_kernels():
    """transformers' Qwen3-Next calls flash-linear-attention's kernels wherever fla imports
    (a GPU machine), also for a model on the CPU, as the reference is: its torch forms."""
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))


@pytest.mark.parametrize("overrides", [{}, {"num_experts": 0}],
                         ids=["moe", "dense"])
def test_qwen3_next_greedy_equals_transformers(overrides):
    check(tiny_qwen3_next(**overrides), mixed_prompts(5, seed=11) + [list(range(5, 80))],
          max_tokens=16)


def test_qwen3_next_prompts_in_chunks_and_preemption():
    llm = check(tiny_qwen3_next(), mixed_prompts(6, seed=12) + [list(range(9, 50))],
                max_tokens=20, max_num_batched_tokens=7, max_mixed_prefill_tokens=7,
                num_kv_blocks=24, max_num_seqs=4)
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton runs on CUDA or interpreted")
@pytest.mark.parametrize("family", ["granite", "qwen3_next"])
def test_decode_steps_each_state_in_its_row(family, monkeypatch):
    """The in-place decode kernels (layers/recurrent_decode.py; interpreted on the CPU) in
    the model: a batch of mixed lengths, and one-token prompts joining decode steps on rows
    that finished sequences left (they start from zeros)."""
    from roseinfer.layers import recurrent_decode
    monkeypatch.setattr(recurrent_decode, "steps_in_place", lambda x: True)
    check(tiny_granite_hybrid() if family == "granite" else tiny_qwen3_next(),
          mixed_prompts(3, seed=14), max_tokens=8)
    test_a_one_token_prompt_joining_decode_steps_starts_from_zeros(family)


def tiny_nemotron_h(**overrides):
    """Mamba2, MLP, attention (no positions), Mamba2, MLP: 8 heads of 8 over 2 groups."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(**{
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention",
                              "mlp"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16,
        "conv_kernel": 4, "chunk_size": 16, "max_position_embeddings": 256,
        "initializer_range": 0.2, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 0, **overrides})
    return spread(NemotronHForCausalLM(config).eval())


def test_nemotron_h_greedy_equals_transformers():
    check(tiny_nemotron_h(), mixed_prompts(5, seed=13) + [list(range(5, 80))], max_tokens=16,
          max_num_batched_tokens=16)


def test_nemotron_h_experts_are_refused_by_name():
    with pytest.raises(ConfigError, match="'moe' blocks are not built yet"):
        LLM(tiny_nemotron_h(layers_block_type=["linear_attention", "moe", "full_attention"]),
            device=DEVICE, dtype="float32")


def test_the_chunked_forms_equal_their_recurrences():
    """Mamba2's SSD chunk and the gated delta rule's closed form against the per-token
    recurrences they stand for, from a nonzero state."""
    from roseinfer.layers.gated_deltanet import _delta_chunk, _l2norm
    from roseinfer.layers.mamba2 import _ssd_chunk

    gen = torch.Generator().manual_seed(0)
    n, length, heads, kdim, vdim = 2, 37, 4, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = _l2norm(rand(n, length, heads, kdim)), _l2norm(rand(n, length, heads, kdim))
    v, start = rand(n, length, heads, vdim), rand(n, heads, kdim, vdim)
    g, beta = -torch.rand(n, length, heads, generator=gen), torch.rand(n, length, heads,
                                                                        generator=gen)
    state, ref_state = start.clone(), start.clone()
    out, ref = _delta_chunk(q, k, v, g, beta, state), torch.empty_like(v)
    for t in range(length):
        ref_state.mul_(g[:, t].exp()[..., None, None])
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", ref_state, k[:, t])) * \
            beta[:, t][..., None]
        ref_state.add_(k[:, t][..., None] * delta[..., None, :])
        ref[:, t] = torch.einsum("bhkv,bhk->bhv", ref_state, q[:, t])
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(state, ref_state, atol=1e-5)

    x, b, c = rand(n, length, heads, vdim), rand(n, length, heads, kdim), rand(n, length,
                                                                               heads, kdim)
    dt = torch.rand(n, length, heads, generator=gen)
    a = -dt * torch.rand(heads, generator=gen)
    start = rand(n, heads, vdim, kdim)
    state, ref_state = start.clone(), start.clone()
    out, ref = _ssd_chunk(x, dt, a, b, c, state), torch.empty_like(x)
    for t in range(length):
        ref_state.mul_(a[:, t].exp()[..., None, None]).add_(
            dt[:, t][..., None, None] * x[:, t][..., None] * b[:, t][:, :, None, :])
        ref[:, t] = torch.einsum("bhpn,bhn->bhp", ref_state, c[:, t])
    assert torch.allclose(out, ref, atol=1e-4) and torch.allclose(state, ref_state, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention's kernels "
                    "run on a GPU (they ask the driver for its properties)")
@pytest.mark.parametrize("layer", ["gated_deltanet", "mamba2"])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (7, 1), (1, 64), (1, 300)])
def test_recurrences_on_fla_kernels_equal_the_torch_reference(layer, batch, tokens):
    """Gated DeltaNet at Qwen3-Next's head shapes (16 key heads, 32 value heads of 128,
    bfloat16 inputs as the GPU model gives them) and Mamba2's SSM at Granite 4.0-H's (128
    heads of 64, state 128), against each layer's float32 closed form."""
    pytest.importorskip("fla.ops")
    from roseinfer.layers import gated_deltanet, mamba2, state_conv

    gen = torch.Generator(device="cuda").manual_seed(batch * 1000 + tokens)

    def randn(*dims, scale=1.0):
        return torch.randn(*dims, generator=gen, device="cuda") * scale

    def rand(*dims):
        return torch.rand(*dims, generator=gen, device="cuda")
    shape = batch, tokens
    if layer == "gated_deltanet":
        run = gated_deltanet.delta_rule
        args = (randn(*shape, 16, 128).bfloat16(), randn(*shape, 16, 128).bfloat16(),
                randn(*shape, 32, 128).bfloat16(), -rand(*shape, 32), rand(*shape, 32))
        state = randn(batch, 32, 128, 128, scale=0.1)
    else:
        run = mamba2.ssm_scan
        dt = rand(*shape, 128) * 0.1
        args = (randn(*shape, 128, 64), dt, -dt * rand(128), randn(*shape, 128, 128, scale=0.1),
                randn(*shape, 128, 128, scale=0.1))
        state = randn(batch, 128, 64, 128, scale=0.1)
    assert state_conv.kernels(state.device, torch.bfloat16) == "fla"
    assert state_conv.kernels(state.device, torch.float32) == "torch"
    out, final = run(*args, state.clone(), "fla")
    want, want_final = run(*args, state.clone(), "torch")
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final, want_final, atol=2e-2, rtol=2e-2)
