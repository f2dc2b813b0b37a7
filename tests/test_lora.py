"""LoRA adapters (core/lora.py, layers/lora.py): greedy ids equal transformers' PeftModel,
merged and unmerged, on tiny random Llama and Qwen configs with adapters made by peft; a
batch of several adapters and base rows equals each request alone; fewer slots than
adapters; preemption and the prefix cache keep adapters apart; two CPU ranks are exact;
bad adapters are refused by name."""
import copy
import json

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.blocks import prompt_hashes, root_hash
from roseinfer.core.errors import ConfigError, InvalidRequestError
from tests.models import hf_greedy, tiny_family, tiny_llama
from tests.test_greedy_equality import mixed_prompts

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=8,
           enable_lora=True)


def make_adapter(base, path, seed, targets=ALL, r=8, **config):
    """A peft adapter on a copy of ``base`` with random A and B (peft starts B at zero:
    the adapter would change nothing), saved at ``path``."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **config))
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def adapters(request, tmp_path_factory):
    """(base model, {name: (path, its PeftModel)}): three adapters, one on the attention
    only, one of rank 16 with rsLoRA."""
    base = tiny_llama() if request.param == "llama" else tiny_family("qwen3")
    specs = {"all": dict(seed=1), "attn": dict(seed=2, targets=["q_proj", "v_proj", "o_proj"]),
             "rs": dict(seed=3, r=16, use_rslora=True)}
    out = {}
    for name, spec in specs.items():
        path = tmp_path_factory.mktemp(f"{request.param}-{name}")
        out[name] = str(path), make_adapter(base, path, **spec)
    return base, out


def serving(base, adapters, **config):
    llm = LLM(base, **{**CPU, "max_loras": 4, **config})
    for name, (path, _) in adapters.items():
        llm.add_lora(name, path)
    return llm


def test_greedy_equals_peft_merged_and_unmerged(adapters):
    base, found = adapters
    prompts = mixed_prompts(4, seed=5)
    llm = serving(base, found)
    for name, (_, model) in found.items():
        outs = llm.generate(prompts, GREEDY, lora=name)
        unmerged = [hf_greedy(model, p, 10) for p in prompts]
        assert [o.token_ids for o in outs] == unmerged, name
        merged = copy.deepcopy(model).merge_and_unload()
        assert [hf_greedy(merged, p, 10) for p in prompts] == unmerged, name
    base_ids = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert base_ids == [hf_greedy(base, p, 10) for p in prompts]
    # the adapters change what the model says: the comparisons above test them
    assert base_ids != [o.token_ids for o in llm.generate(prompts, GREEDY, lora="all")]


def test_a_mixed_batch_equals_each_request_alone(adapters):
    """Three adapters and base rows in one batch, through prefill chunks and decode
    windows, with two slots for three adapters: requests wait for a slot."""
    base, found = adapters
    prompts = mixed_prompts(8, seed=6)
    names = ["all", None, "attn", "rs", "all", "rs", None, "attn"]
    want = [hf_greedy(found[n][1] if n else base, p, 10) for p, n in zip(prompts, names)]
    for config in (dict(max_loras=4), dict(max_loras=2, max_num_batched_tokens=16,
                                           decode_steps=4, decode_steps_min_seqs=1)):
        llm = serving(base, found, **config)
        outs = llm.generate(prompts, GREEDY, lora=names)
        assert [o.token_ids for o in outs] == want, config
    assert llm.engine.loras.num_swaps >= 3


def test_preemption_and_the_prefix_cache_keep_adapters_apart(adapters):
    """One long shared prompt under two adapters and the base model, in a pool small
    enough to preempt: no request reads K/V another adapter computed, and a repeat
    under the same adapter reads its own."""
    base, found = adapters
    prompt = mixed_prompts(1, seed=7)[0] * 3 + [5, 6, 7]
    names = ["all", "attn", None, "all"]
    llm = serving(base, found, num_kv_blocks=24, max_num_seqs=4, enable_prefix_cache=True)
    outs = llm.generate([prompt] * 4, GREEDY, lora=names)
    for o, n in zip(outs, names):
        assert o.token_ids == hf_greedy(found[n][1] if n else base, prompt, 10), n
    assert llm.engine.stats().num_preemptions > 0
    llm = serving(base, found, enable_prefix_cache=True)  # room to keep every block
    cached = []
    for name in ("all", "attn", None, "attn", "all"):
        out = llm.generate([prompt], GREEDY, lora=name)[0]
        assert out.token_ids == hf_greedy(found[name][1] if name else base, prompt, 10)
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] > 0 and cached[4] > 0


def test_hashes_of_an_adapter_are_its_own():
    ids = list(range(40))
    assert prompt_hashes(ids, 4, root_hash("a")) != prompt_hashes(ids, 4, root_hash("b"))
    assert prompt_hashes(ids, 4, root_hash(None)) == prompt_hashes(ids, 4)
    assert root_hash("a") == root_hash("a")  # a digest: the same in every process


def test_n_samples_share_their_adapter(adapters):
    base, found = adapters
    prompt = mixed_prompts(1, seed=8)[0] + list(range(10, 20))
    llm = serving(base, found, enable_prefix_cache=True)
    outs = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=0,
                                                  ignore_eos=True), lora="rs")[0]
    want = hf_greedy(found["rs"][1], prompt, 10)
    assert [o.token_ids for o in outs] == [want] * 3


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2
                                                else []))
def test_two_ranks_are_token_exact(adapters, tmp_path, device):
    """Over gloo, and over NCCL in CUDA graphs where two GPUs are present."""
    base, found = adapters
    base.save_pretrained(tmp_path)
    prompts = mixed_prompts(4, seed=9)
    names = ["all", "attn", None, "rs"]
    llm = LLM(str(tmp_path), **{**CPU, "device": device, "tensor_parallel_size": 2,
                                "max_loras": 2, "decode_steps_min_seqs": 1})
    try:
        for name, (path, _) in found.items():
            llm.add_lora(name, path)
        outs = llm.generate(prompts, GREEDY, lora=names)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == \
        [hf_greedy(found[n][1] if n else base, p, 10) for p, n in zip(prompts, names)]


# ---------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def llama_llm():
    return LLM(tiny_llama(), **CPU)


def test_an_unknown_adapter_is_a_bad_request(llama_llm):
    with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'") as e:
        llama_llm.generate([[3, 4]], GREEDY, lora="nope")
    assert e.value.code == "bad_request" and e.value.field == "lora"
    plain = LLM(tiny_llama(), **{**CPU, "enable_lora": False})
    with pytest.raises(InvalidRequestError, match="serves no adapters"):
        plain.generate([[3, 4]], GREEDY, lora="x")
    with pytest.raises(ConfigError, match="enable_lora"):
        plain.add_lora("x", "/nowhere")


def _saved(tmp_path, base, **config):
    make_adapter(base, tmp_path, seed=0, **config)
    return tmp_path


@pytest.mark.parametrize("change, error", [
    (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    (lambda p: (p / "adapter_config.json").write_text("{"), "not readable JSON"),
    (lambda p: _edit(p, r=64), "rank 64, above max_lora_rank 16"),
    (lambda p: _edit(p, use_dora=True), "use_dora"),
    (lambda p: _drop(p, "lora_B"), "but not its other half"),
])
def test_malformed_adapters_are_refused_by_name(llama_llm, tmp_path, change, error):
    path = _saved(tmp_path, tiny_llama(), r=8)
    change(path)
    with pytest.raises(ConfigError, match=error) as e:
        llama_llm.add_lora("bad", str(path))
    assert "'bad'" in str(e.value)
    assert "bad" not in llama_llm.engine.lora_names


def _edit(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


def _drop(path, part):
    from safetensors.torch import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    key = next(k for k in tensors if part in k)
    save_file({k: v for k, v in tensors.items() if k != key}, file)


def test_a_module_not_adapted_and_another_base_are_refused(llama_llm, tmp_path):
    with pytest.raises(ConfigError, match="lm_head"):
        llama_llm.add_lora("head", str(_saved(tmp_path / "h", tiny_llama(),
                                              targets=["q_proj", "lm_head"])))
    with pytest.raises(ConfigError, match="made for another base model"):
        llama_llm.add_lora("other", str(_saved(tmp_path / "o", tiny_llama(hidden_size=48))))
    # its first layer's MLP is experts; a Llama adapter of its shape adapts it
    moe = LLM(tiny_family("qwen3_moe"), **CPU)
    with pytest.raises(ConfigError, match="layers.0.gate_proj"):
        moe.add_lora("mlp", str(_saved(tmp_path / "m", tiny_llama(),
                                       targets=["q_proj", "gate_proj"])))


def test_an_adapter_in_use_is_not_removed(adapters):
    base, found = adapters
    llm = serving(base, {"all": found["all"]})
    llm.engine.add_request("r", [3, 4, 5], GREEDY, lora="all")
    with pytest.raises(ConfigError, match="still serves 1 request"):
        llm.remove_lora("all")
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.remove_lora("all")
    assert llm.engine.lora_names == []
    with pytest.raises(InvalidRequestError, match="unknown adapter"):
        llm.generate([[3]], GREEDY, lora="all")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_in_cuda_graphs(adapters):
    """Mixed adapters through CUDA graphs (decode windows, mixed steps) and the Triton
    kernels equal transformers' PeftModel."""
    base, found = adapters
    prompts = mixed_prompts(8, seed=12)
    names = ["all", None, "attn", "rs"] * 2
    llm = LLM(base, **{**CPU, "device": "cuda", "max_loras": 2, "decode_steps_min_seqs": 1})
    for name, (path, _) in found.items():
        llm.add_lora(name, path)
    outs = llm.generate(prompts, GREEDY, lora=names)
    assert llm.engine.runner.graphs is not None
    assert [o.token_ids for o in outs] == \
        [hf_greedy(found[n][1] if n else base, p, 10) for p, n in zip(prompts, names)]


def test_steps_without_an_adapter_launch_no_lora_kernels(adapters, monkeypatch):
    """A LoRA engine's steps with no adapted token run the base projections alone, eager
    or in decode graphs (captured with and without the LoRA launches; on the CPU their
    steps stand in for them; prefill steps run eagerly here): no shrink or expand
    launch, the base model's tokens. A batch with an adapter runs them, and equals peft."""
    from roseinfer.layers import lora as lora_layer
    from tests.test_mixed_graphs import llm_with_graphs
    base, found = adapters
    launches = []
    for name in ("add_lora", "shrink"):
        real = getattr(lora_layer, name)
        monkeypatch.setattr(lora_layer, name, lambda *a, _real=real, **k: (
            launches.append(1), _real(*a, **k))[1])
    prompts = mixed_prompts(2, seed=13)
    config = {**CPU, "max_loras": 2, "attention_backend": "torch_sdpa"}
    graphed = {**config, "mixed_graph_max_tokens": 0, "attention_backend": "triton_paged",
               "device": "cuda" if torch.cuda.is_available() else "cpu"}
    for llm in (LLM(base, **config), llm_with_graphs(base, monkeypatch, **graphed)):
        llm.add_lora("all", found["all"][0])
        launches.clear()
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [hf_greedy(base, p, 10) for p in prompts]
        assert launches == []
        outs = llm.generate(prompts, GREEDY, lora=["all", None])
        assert [o.token_ids for o in outs] == \
            [hf_greedy(found["all"][1], prompts[0], 10), hf_greedy(base, prompts[1], 10)]
        assert launches
    graphs = llm.engine.runner.graphs
    assert {key[2] for key in graphs.graphs} == {False, True}
    if not torch.cuda.is_available():  # the stand-ins count their replays
        assert graphs.replays["capture_step"] > 0
