"""Tensor parallelism on the CPU: gloo, one process per rank, token-exact with
transformers and with one process; the shards a rank loads; a rank that dies."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core import tp
from roseinfer.core.cuda_graphs import Layout
from roseinfer.core.errors import ConfigError
from roseinfer.core.step_order import STOP, StepOrder, decode
from roseinfer.models import loader
from tests.models import MOE_FAMILIES, hf_greedy, per_expert_checkpoint, tiny_family, tiny_gpt2, \
    tiny_llama
from tests.test_deepseek import tiny_deepseek, tiny_glm4_moe
from tests.test_greedy_equality import mixed_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Where two GPUs are present the same tests run there too: NCCL, CUDA graphs, windows.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])
CPU = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_kv_blocks": 128,
       "max_num_seqs": 8}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, the transformers model saved there)."""
    models = {"gpt2": tiny_gpt2(), "llama": tiny_llama(),
              # one K/V head for two ranks: replicated
              "llama-1kv": tiny_llama(num_attention_heads=4, num_key_value_heads=1,
                                      hidden_size=48, tie_word_embeddings=True),
              "qwen2": tiny_family("qwen2"), "phi3": tiny_family("phi3"),
              **{family: tiny_family(family)
                 for family in (*MOE_FAMILIES, "gemma2", "gemma3_text")},
              # latent attention by head, the whole latent cache on each rank; shared experts
              "deepseek_v3": tiny_deepseek(),
              "deepseek_v2": tiny_deepseek(2, topk_method="group_limited_greedy",
                                           q_lora_rank=None, routed_scaling_factor=1.5),
              "glm4_moe": tiny_glm4_moe(use_qk_norm=True)}
    out = {}
    for name, hf in models.items():
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = str(path), hf
    return out


def run(path, prompts, params=GREEDY, **config):
    llm = LLM(path, **{**CPU, "decode_steps_min_seqs": 1, **config})
    try:
        return llm.generate(prompts, params), llm.engine.stats()
    finally:
        llm.engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-1kv", "qwen2", "phi3", *MOE_FAMILIES,
                                  "gemma2", "gemma3_text", "deepseek_v3", "deepseek_v2",
                                  "glm4_moe"])
def test_two_ranks_equal_transformers_greedy(saved, name, device):
    """Prompts of 1-23 tokens in chunks of at most 16 tokens a step (chunked prefill)."""
    path, hf = saved[name]
    prompts = mixed_prompts(5, seed=4)
    outs, _ = run(path, prompts, tensor_parallel_size=2, max_num_batched_tokens=16,
                  device=device)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_one_shot_all_reduce_gives_nccl_tokens_in_bf16(saved, name, monkeypatch):
    """bf16 (the one-shot path takes half types only): its sums are NCCL's bit for bit at
    two ranks, and its fused add-norm is the add-norm kernel's, so every token is."""
    path, _ = saved[name]
    prompts = mixed_prompts(8, seed=5)
    config = {**CPU, "decode_steps_min_seqs": 1, "device": "cuda", "dtype": "bfloat16",
              "tensor_parallel_size": 2, "max_num_batched_tokens": 16}
    tokens = []
    for one_shot in ("1", "0"):
        monkeypatch.setenv("ROSEINFER_ONE_SHOT", one_shot)
        llm = LLM(path, **config)
        try:
            assert (tp._one_shot is not None) == (one_shot == "1")
            tokens.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
        finally:
            llm.engine.close()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_and_preemption_over_two_ranks(saved, device):
    path, hf = saved["llama"]
    shared = list(range(10, 27))
    prompts = [shared + [40], shared + [41, 42], shared[:9], shared] + mixed_prompts(3, seed=6)
    outs, stats = run(path, prompts, GREEDY, tensor_parallel_size=2, num_kv_blocks=16,
                      enable_prefix_cache=True, device=device)
    assert stats.num_preemptions > 0, "the pool should have forced preemption"
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_and_processed_rows_equal_one_process(saved, device):
    """Rank 0 alone samples and applies penalties and logit bias: the other rank
    must decode from the same ids, so the texts equal one process's."""
    path, _ = saved["gpt2"]
    prompts = mixed_prompts(4, seed=8)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True,
                             presence_penalty=0.5 * (i % 2), logit_bias={7: 2.0} if i == 3 else {})
              for i in range(4)]
    one, _ = run(path, prompts, params, device=device)
    two, _ = run(path, prompts, params, tensor_parallel_size=2, device=device)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


@pytest.mark.parametrize("device", DEVICES)
def test_drafts_are_checked_over_two_ranks(tmp_path, device):
    """Speculative decoding over two ranks: every rank computes the draft positions'
    logits (the order's extra rows), rank 0 accepts; greedy ids equal transformers'. A
    16-token vocabulary makes the output loop, so prompt lookup drafts most of it."""
    hf = tiny_llama(vocab=16)
    hf.save_pretrained(tmp_path)
    prompts = [[3, 9, 4, 12, 7, 5], [11, 2, 6, 6, 8, 13]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs, stats = run(str(tmp_path), prompts, params, tensor_parallel_size=2, device=device,
                      speculative="ngram", num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 30) for p in prompts]
    assert stats.num_accepted_tokens > 0, stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parallel_ranks_equal_transformers_greedy(saved, family, device):
    """Each of two ranks holds 4 of the 8 experts whole and computes the pairs routed to
    them; attention and any shared expert stay split as under tensor parallelism."""
    path, hf = saved[family]
    prompts = mixed_prompts(5, seed=4)
    outs, _ = run(path, prompts, tensor_parallel_size=2, enable_expert_parallel=True,
                  max_num_batched_tokens=16, device=device)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "gpt_oss"])
def test_a_rank_cuts_stacked_experts_as_it_cuts_one_per_expert(family, expert_parallel):
    """Checkpoints on disk hold one tensor per expert (what the tests above load), and
    transformers' in-memory ones hold them stacked: each rank's share of every expert
    is the same either way, and OLMoE's q/k norms are cut by head."""
    from roseinfer.models.moe import MoeForCausalLM

    hf = tiny_family(family)
    for rank in range(2):
        with tp.assume(rank, 2, expert_parallel):
            want, got = (MoeForCausalLM.convert_hf_state_dict(
                loader._shards(MoeForCausalLM, sd, hf.config), hf.config)
                for sd in (per_expert_checkpoint(hf), hf.state_dict()))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        # 8 experts of 2 x 48 rows: each rank's half of every one, or half of them whole
        assert want["layers.0.moe.w13"].shape == ((4, 96, 72) if expert_parallel else (8, 48, 72))
        if family == "olmoe":
            assert want["layers.0.q_norm.weight"].equal(hf.model.layers[0].self_attn.q_norm
                                                         .weight[rank * 36:(rank + 1) * 36])


def test_a_vocabulary_smaller_than_a_ranks_rows_pads_the_last_rank():
    """16 tokens over two ranks of 64 rows each: rank 1's range starts past the end, and
    reads as zeros (it read as 112 rows before)."""
    from roseinfer.models import sharding

    table = torch.arange(1, 17, dtype=torch.float32).view(16, 1)
    with tp.assume(0, 2):
        first = sharding.take(table, sharding.vocab(16))
    with tp.assume(1, 2):
        second = sharding.take(table, sharding.vocab(16))
    assert first.shape == second.shape == (64, 1)
    assert first[:16].equal(table) and not first[16:].any() and not second.any()


def states(path, size):
    """Each rank's state dict (float64: CPU float32 linears keep packed weights)."""
    out = []
    for rank in range(size):
        with tp.assume(rank, size):
            out.append(loader.load(path, dtype=torch.float64)[0].state_dict())
    return out


def test_each_rank_loads_its_own_slices(saved):
    """Every rank's shards, put back together, are the checkpoint's tensors; and
    the module of each rank takes its state dict strictly."""
    path, _ = saved["llama"]
    (full,) = states(path, 1)
    parts = states(path, 2)
    a, b = parts
    layer = "layers.0."
    h, d = 3, 12  # 6 heads of 12 over 2 ranks; 2 K/V heads: one each
    qkv = [torch.cat(x) for x in zip(*(p[layer + "qkv_proj.weight"].split([h * d, d, d])
                                     for p in parts))]
    assert torch.equal(torch.cat(qkv), full[layer + "qkv_proj.weight"])
    assert torch.equal(torch.cat([a[layer + "o_proj.weight"], b[layer + "o_proj.weight"]], 1),
                       full[layer + "o_proj.weight"])
    vocab = torch.cat([a["embed_tokens.weight"], b["embed_tokens.weight"]])
    assert torch.equal(vocab[:512], full["embed_tokens.weight"])
    assert vocab.shape[0] == 2 * 256 and not vocab[512:].any()
    assert torch.equal(a["norm.weight"], full["norm.weight"])


def test_row_parallel_bias_is_added_by_rank_zero_only(saved):
    path, _ = saved["gpt2"]
    (full,), (a, b) = states(path, 1), states(path, 2)
    key = "h.0.mlp_proj.bias"
    assert torch.equal(a[key], full[key]) and not b[key].any()


def test_sizes_that_do_not_divide_the_model_are_refused(saved):
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide"):
        LLM(saved["llama"][0], **CPU, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="needs the model as a path"):
        LLM(saved["llama"][1], **CPU, tensor_parallel_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_collectives_replay_inside_cuda_graphs(monkeypatch, gpt2_model):
    """One GPU: an NCCL group of one, with the helpers made to call NCCL anyway. The
    decode, window and mixed graphs hold the all-reduces, the logits gather and the
    ids broadcast, and their replays give transformers' tokens."""
    import torch.distributed as dist

    from roseinfer.core import runner
    from roseinfer.core.tp_workers import _free_port

    def all_reduce(x):
        dist.all_reduce(x)
        return x

    def gather_columns(x):
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    def broadcast(x):
        dist.broadcast(x, 0)
        return x

    tp.init(0, 1, _free_port(), torch.device("cuda", 0))
    try:
        monkeypatch.setattr(tp, "all_reduce", all_reduce)
        monkeypatch.setattr(tp, "gather_columns", gather_columns)
        monkeypatch.setattr(tp, "broadcast", broadcast)
        monkeypatch.setattr(runner.ModelRunner, "_share",
                            lambda self, n: broadcast(self.sampled[:n]))
        prompts = mixed_prompts(12, seed=3)
        llm = LLM(gpt2_model, **{**CPU, "device": "cuda", "max_num_seqs": 16, "num_kv_blocks": 256,
                                 "decode_steps_min_seqs": 1, "max_num_batched_tokens": 64})
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                        ignore_eos=True))
            assert [o.token_ids for o in outs] == [hf_greedy(gpt2_model, p, 40) for p in prompts]
    finally:
        tp.destroy()


@pytest.mark.parametrize("layout", [None, Layout(8, 4, False), Layout(8, 4, True),
                                    Layout(8, 4, True, True)])
def test_a_step_order_survives_its_message(layout):
    order = StepOrder(np.arange(40, dtype=np.int32), 8, 4, 2, layout, 3, 3, 5, 1,
                      True, [(1, 2), (7, 9)], [0, 5])
    back = decode(order.encode())
    assert back.layout == layout and back.copies == [(1, 2), (7, 9)]
    assert back.extra_rows == [0, 5] and np.array_equal(back.packed, order.packed)
    assert (back.n_tok, back.n_seq, back.n_upd, back.real_seqs, back.n_rows, back.steps,
            back.max_query_len, back.replay) == (8, 4, 2, 3, 3, 5, 1, True)
    assert decode(STOP) is None


def test_a_rank_that_dies_takes_the_group_down(saved, tmp_path):
    """Rank 1 killed mid-generation: rank 0 exits with an error naming it, not hangs."""
    path, _ = saved["gpt2"]
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from roseinfer import LLM, SamplingParams
        llm = LLM({path!r}, device="cpu", block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
        print("ready", llm.engine.peers.procs[0].pid, flush=True)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, ignore_eos=True))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), proc.stderr.read()
        time.sleep(1.0)
        os.kill(int(line.split()[1]), signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code != 0
    assert "tensor-parallel rank 1" in proc.stderr.read()


@pytest.mark.parametrize("device", DEVICES)
def test_engines_one_after_another_in_one_process(saved, device):
    """close(), the context manager, and del plus a collection each leave the group and
    stop the other rank, so the next tensor-parallel engine starts."""
    import gc

    path, hf = saved["llama"]
    expected = [hf_greedy(hf, p, 12) for p in mixed_prompts(2, seed=1)]
    config = {**CPU, "tensor_parallel_size": 2, "device": device}

    def served(llm):
        return [o.token_ids for o in llm.generate(mixed_prompts(2, seed=1), GREEDY)] == expected

    llm = LLM(path, **config)
    ranks = llm.engine.peers.procs
    assert served(llm)
    llm.close()
    assert all(p.poll() is not None for p in ranks) and not tp.group().size > 1
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], GREEDY)
    with LLM(path, **config) as llm:
        ranks = llm.engine.peers.procs
        assert served(llm)
    assert all(p.poll() is not None for p in ranks)
    llm = LLM(path, **config)
    ranks = llm.engine.peers.procs
    assert served(llm)
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in ranks)
    with LLM(path, **config) as llm:
        assert served(llm)
        with pytest.raises(ConfigError, match="close the engine"):
            LLM(path, **config)  # two groups at once: refused, and the first one goes on
        assert served(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_close_gives_the_gpu_memory_back(saved):
    path, _ = saved["llama"]
    before = torch.cuda.memory_reserved()
    llm = LLM(path, device="cuda", num_kv_blocks=4096)
    llm.generate([[1, 2, 3]], GREEDY)
    assert torch.cuda.memory_reserved() > before
    llm.close()
    assert torch.cuda.memory_reserved() <= before
