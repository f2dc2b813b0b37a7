"""Quantized models (models/quantization.py, plugins/quantization/): checkpoints written by
the formats' own tools (compressed-tensors) or by hand from their specs (AWQ, GPTQ),
and quantization at load, each against transformers running the same quantized
values; the errors a user meets; a method registered from outside."""
import copy
import inspect
import json

import pytest
import torch
from safetensors.torch import save_file

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import ConfigError
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.plugins import PluginRegistry, UnknownPluginError
from roseinfer.models.quantization import quantizable
from tests.models import hf_greedy, per_expert_checkpoint, tiny_family, tiny_llama

FP8 = torch.float8_e4m3fn
STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [200, 1, 42], [7] * 9, [300, 301, 302, 303, 304, 305]]
# Input sizes that are multiples of the int4 group (128).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.05)


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(**SHAPE)


def ours(path, **config):
    with LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
             cpu_compiled_step="off", **config) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def reference(model):
    return [hf_greedy(model, p, STEPS) for p in PROMPTS]


def linears(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]


def with_weights(hf, weight_of):
    """A copy of ``hf`` whose linears (not the LM head) hold ``weight_of(name, weight)``."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in linears(model):
            m.weight.copy_(weight_of(name, m.weight))
    return model


def fp8_round(x, dim=-1):
    scale = x.abs().amax(dim=dim, keepdim=True) / 448
    return (x / scale).to(FP8).float() * scale


def fp8_activations(model):
    """Round each linear's input to FP8 per token, as W8A8 dynamic does."""
    for _, m in linears(model):
        m.register_forward_pre_hook(lambda mod, args: (fp8_round(args[0]),))
    return model


def save(model, path, tensors=None, quantization_config=None):
    model.config.save_pretrained(path)
    if quantization_config is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else
              {k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    return str(path)


# ---------------------------------------------------------------- FP8

def test_fp8_at_load_equals_transformers_on_fp8_values(hf, tmp_path):
    path = save(hf, tmp_path)
    want = reference(fp8_activations(with_weights(hf, lambda _, w: fp8_round(w))))
    assert ours(path, quantization="fp8") == want
    assert ours(path) != want, "fp8 must change this model's output, or the test shows nothing"


def fp8_moe_reference(hf):
    """``hf`` as its FP8 run computes: dense linears W8A8 as above; the experts' rows
    rounded to FP8 with their inputs kept (W8A16); the router (not an nn.Linear in
    transformers) whole."""
    model = fp8_activations(with_weights(hf, lambda _, w: fp8_round(w)))
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            for w in (experts.gate_up_proj, experts.down_proj) if experts else ():
                w.copy_(fp8_round(w))
    return reference(model)


def test_fp8_experts_at_load_equal_transformers_on_fp8_values(tmp_path):
    hf = tiny_family("qwen3_moe")
    path = save(hf, tmp_path)
    want = fp8_moe_reference(hf)
    assert ours(path, quantization="fp8") == want
    assert ours(path) != want, "fp8 must change this model's output, or the test shows nothing"


def test_compressed_tensors_fp8_experts_equal_transformers_on_their_values(tmp_path):
    """A mixture of experts as llm-compressor's FP8_DYNAMIC checkpoints hold it: one tensor
    per expert and projection, each in e4m3 with a scale per row beside it, as the
    attention's are; the routers and the LM head whole (its ``ignore``)."""
    hf = tiny_family("qwen3_moe")
    tensors = per_expert_checkpoint(hf)
    for key in {f"{n}.weight" for n, _ in linears(hf)} | {k for k in tensors if ".experts." in k}:
        w = tensors[key].float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        tensors[key], tensors[key + "_scale"] = (w / scale).to(FP8), scale
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                          "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                    "symmetric": True, "dynamic": True}}
    path = save(hf, tmp_path, tensors, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": scheme}, "ignore": ["lm_head", "re:.*mlp.gate$"]})
    want = fp8_moe_reference(hf)
    assert ours(path) == want
    assert reference(hf) != want, "FP8 must change this model's output, or the test shows nothing"


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 of ``w`` [..., K] (K a multiple of 32): (blocks [..., K / 32, 16]
    uint8, two e2m1 codes a byte, the even column's low; scales [..., K / 32] uint8, the
    shared exponent + 127), each value the nearest code after a power of two that brings
    its block's largest magnitude to at most 6."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 6))
    values = torch.tensor(FP4_VALUES)
    codes = ((groups / 2 ** exp)[..., None] - values).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8)


def test_mxfp4_gpt_oss_experts_equal_transformers_on_their_values(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales, as OpenAI's are
    ([E, rows, K / 32, 16] with K the input dim): loaded through the mxfp4 method, greedy
    ids equal transformers' on the same values, which transformers' own
    convert_moe_packed_tensors de-quantizes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_family("gpt_oss", hidden_size=64, intermediate_size=32)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    want_model = copy.deepcopy(hf)
    for i, layer in enumerate(want_model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, K, N]: its rows are the inputs
            blocks, scales = mxfp4(param.detach().transpose(1, 2))
            key = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    path = save(hf, tmp_path, tensors, quantization_config={"quant_method": "mxfp4"})
    want = reference(want_model)
    assert ours(path) == want
    assert reference(hf) != want, "MXFP4 must change this model's output, or the test shows nothing"


def test_mxfp4_does_not_quantize_a_float_model(hf, tmp_path):
    with pytest.raises(ConfigError, match="does not quantize a float model"):
        ours(save(hf, tmp_path), quantization="mxfp4")


def compressed_tensors_checkpoint(hf, path, preset, fmt, scale_of):
    """Quantize with compressed-tensors' own scheme and compressor (what llm-compressor
    runs after its observers), our scales set by ``scale_of``; save as it writes."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, \
        preset_name_to_scheme

    model = copy.deepcopy(hf)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    for _, m in linears(model):
        m.weight_scale.data = scale_of(m.weight.detach()).to(m.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return str(path)


def test_compressed_tensors_fp8_dynamic_equals_transformers_loading_it(hf, tmp_path):
    from transformers import AutoModelForCausalLM

    path = compressed_tensors_checkpoint(
        hf, tmp_path, "FP8_DYNAMIC", "float-quantized",
        lambda w: w.abs().amax(dim=1, keepdim=True) / 448)
    want = reference(AutoModelForCausalLM.from_pretrained(path).eval())
    assert ours(path) == want  # the checkpoint's quantization_config picks fp8
    assert ours(path, quantization="fp8") == want


# ---------------------------------------------------------------- INT4

def int4_levels(w, group=128):
    """Symmetric 4-bit levels and bfloat16 scales (as torch's int4 kernel keeps them) per
    group of ``group`` input columns."""
    groups = w.view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    return (groups / scale).round().clamp(-8, 7).to(torch.int8).view_as(w), scale.squeeze(-1)


def int4_dequant(w, group=128):
    q, scale = int4_levels(w, group)
    return (q.view(w.shape[0], -1, group).float() * scale.unsqueeze(-1)).view_as(w)


def test_int4_at_load_equals_transformers_on_int4_values(hf, tmp_path):
    path = save(hf, tmp_path)
    want = reference(with_weights(hf, lambda _, w: int4_dequant(w)))
    assert ours(path, quantization="int4") == want
    assert ours(path) != want


def test_compressed_tensors_w4a16_equals_its_unpacked_values(hf, tmp_path):
    """Written by compressed-tensors' pack-quantized compressor; the reference's weights
    are the library's own unpacking of what it wrote, times its scales."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    path = compressed_tensors_checkpoint(
        hf, tmp_path, "W4A16", "pack-quantized",
        lambda w: w.view(w.shape[0], -1, 128).abs().amax(-1) / 7.5)
    stored = safe_open(f"{path}/model.safetensors", "pt")

    def unpacked(name, w):
        packed, scale = (stored.get_tensor(f"{name}.weight_{p}") for p in ("packed", "scale"))
        q = unpack_from_int32(packed, 4, torch.Size(w.shape)).float()
        return q * scale.float().repeat_interleave(128, dim=1)
    want = reference(with_weights(hf, unpacked))
    assert ours(path) == want


def pack_rows(q):
    """[R, C] 4-bit values (0..15) -> [R / 8, C] int32, value 8r + i in nibble i."""
    q = q.to(torch.int32).view(-1, 8, q.shape[1])
    return sum(q[:, i] << (4 * i) for i in range(8)).to(torch.int32)


def pack_cols(q, order=range(8)):
    """[R, C] 4-bit values -> [R, C / 8] int32; nibble i holds column ``order[i]`` of 8."""
    q = q.to(torch.int32).view(q.shape[0], -1, 8)
    return sum(q[..., c] << (4 * i) for i, c in enumerate(order)).to(torch.int32)


def asymmetric_int4(w, group=128):
    """Unsigned 4-bit levels with a zero point per group: (q, zeros, scales), each
    [groups, out]-shaped as AWQ and GPTQ store them (input-major)."""
    wt = w.t().contiguous()  # [in, out]
    g = wt.view(-1, group, wt.shape[1])
    lo, hi = g.amin(1), g.amax(1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (g / scales[:, None] + zeros[:, None]).round().clamp(0, 15).view_as(wt)
    return q.to(torch.int32), zeros.to(torch.int32), scales.half()


def dequant_asymmetric(q, zeros, scales, group=128):
    z = zeros.repeat_interleave(group, 0)
    return ((q - z) * scales.float().repeat_interleave(group, 0)).t()


def hf_names(model):
    return {name: m for name, m in linears(model)}


def hand_packed(hf, path, layout):
    """A checkpoint packed by hand from the formats' specs: AWQ's GEMM layout (qweight
    [in, out / 8] with columns in nibble order 0 2 4 6 1 3 5 7, qzeros likewise, fp16
    scales) or GPTQ's v1 (qweight [in / 8, out] packed along the input, qzeros [groups,
    out / 8] holding zero - 1, g_idx); and each linear's de-quantized values."""
    tensors, values = {}, {}
    for name, m in hf_names(hf).items():
        q, zeros, scales = asymmetric_int4(m.weight.detach())
        values[name] = dequant_asymmetric(q, zeros, scales)
        if layout == "awq":
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            tensors.update({f"{name}.qweight": pack_cols(q, order),
                            f"{name}.qzeros": pack_cols(zeros, order)})
        else:
            tensors.update({f"{name}.qweight": pack_rows(q),
                            f"{name}.qzeros": pack_cols(zeros - 1),
                            f"{name}.g_idx": torch.arange(q.shape[0], dtype=torch.int32) // 128})
        tensors[f"{name}.scales"] = scales
    for key, t in hf.state_dict().items():
        if key.rpartition(".")[0] not in values:
            tensors[key] = t.contiguous()
    config = {"quant_method": layout, "bits": 4, "group_size": 128}
    config.update({"version": "gemm", "zero_point": True} if layout == "awq" else
                  {"desc_act": False, "sym": False})
    return save(hf, path, tensors, config), values


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_awq_and_gptq_layouts_equal_their_values(hf, tmp_path, layout):
    path, values = hand_packed(hf, tmp_path, layout)
    assert ours(path) == reference(with_weights(hf, lambda name, _: values[name]))


def act_order(hf, path):
    """A GPTQ desc_act checkpoint: each input column's group is its g_idx, in no order;
    and each linear's de-quantized values."""
    tensors, values = {}, {}
    gen = torch.Generator().manual_seed(5)
    for name, m in hf_names(hf).items():
        k = m.weight.shape[1]
        g_idx = torch.randperm(k, generator=gen) // 128
        q = torch.randint(0, 16, (k, m.weight.shape[0]), generator=gen, dtype=torch.int32)
        zeros = torch.randint(4, 12, (k // 128, m.weight.shape[0]), generator=gen,
                              dtype=torch.int32)
        scales = (torch.rand(k // 128, m.weight.shape[0], generator=gen) / 50).half()
        values[name] = ((q - zeros[g_idx]) * scales[g_idx].float()).t()
        tensors.update({f"{name}.qweight": pack_rows(q), f"{name}.qzeros": pack_cols(zeros - 1),
                        f"{name}.g_idx": g_idx.to(torch.int32), f"{name}.scales": scales})
    for key, t in hf.state_dict().items():
        if key.rpartition(".")[0] not in values:
            tensors[key] = t.contiguous()
    return save(hf, path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                    "desc_act": True, "sym": False}), values


def test_gptq_act_order_equals_its_values(hf, tmp_path):
    """De-quantized at load: its groups are not runs of the input."""
    path, values = act_order(hf, tmp_path)
    assert ours(path) == reference(with_weights(hf, lambda name, _: values[name]))


def test_packed_parts_are_cut_as_their_layers_weight():
    """A rank reads only its own words: the cut of a layer's weight [N, K], in outputs
    (dim 0) or inputs (dim 1), is mapped to each format's packed parts."""
    from roseinfer.models.sharding import Shard
    from roseinfer.plugins.quantization.int4 import Int4

    outputs, inputs = Shard(0, ((64, 128),)), Shard(1, ((256, 512),))
    awq = Int4({"quant_method": "awq", "bits": 4, "group_size": 128})
    assert awq.part_shard("l.qweight", outputs, {}) == Shard(1, ((8, 16),))
    assert awq.part_shard("l.qweight", inputs, {}) == Shard(0, ((256, 512),))
    assert awq.part_shard("l.qzeros", inputs, {}) == Shard(0, ((2, 4),))
    assert awq.part_shard("l.scales", outputs, {}) == Shard(1, ((64, 128),))
    assert awq.part_shard("l.bias", outputs, {}) == outputs  # not a packed part
    gptq = Int4({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert gptq.part_shard("l.qweight", inputs, {}) == Shard(0, ((32, 64),))
    assert gptq.part_shard("l.g_idx", outputs, {}) is None
    act = Int4({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    assert act.part_shard("l.scales", inputs, {}) is None  # any rank may use any group
    channel = Int4({"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                        "strategy": "channel"}}}})
    assert channel.part_shard("l.weight_packed", inputs, {}) == Shard(1, ((32, 64),))
    assert channel.part_shard("l.weight_scale", inputs, {}) is None
    with pytest.raises(ConfigError, match="does not split evenly"):
        awq.part_shard("l.qweight", Shard(0, ((0, 12),)), {})


# ---------------------------------------------------------------- errors and plugins

def test_errors_name_the_method_or_format_and_list_what_is_supported(hf, tmp_path):
    path = save(hf, tmp_path / "float")
    with pytest.raises(UnknownPluginError, match="'fp4'.*registered: block_fp8, fp8, int4"):
        ours(path, quantization="fp4")
    bnb = save(hf, tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes",
                                                          "load_in_4bit": True})
    with pytest.raises(ConfigError, match="bitsandbytes.*no quantization method.*fp8: .*int4: "):
        ours(bnb)
    awq = save(hf, tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4,
                                                          "group_size": 128})
    with pytest.raises(ConfigError, match="quantization='fp8' does not read .*awq"):
        ours(awq, quantization="fp8")
    gemv = save(hf, tmp_path / "gemv", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    with pytest.raises(ConfigError, match="GEMM layout, not version 'gemv'"):
        ours(gemv)
    with pytest.raises(ConfigError, match="choose one"):
        ours(path, quantization="fp8", cpu_weight_dtype="int8")
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                        "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}}}
    static = save(hf, tmp_path / "static", quantization_config=fp8)
    with pytest.raises(ConfigError, match="static input scales.*FP8_DYNAMIC"):
        ours(static)
    del fp8["config_groups"]["group_0"]["input_activations"]
    kv = save(hf, tmp_path / "kv", quantization_config={**fp8, "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}})
    with pytest.raises(ConfigError, match="KV cache scales"):
        ours(kv)


class HalfWeights:
    """An outside method: weights rounded to bfloat16, nothing else."""

    formats = "none (at load only)"

    @staticmethod
    def reads(qc):
        return False

    def __init__(self, qc):
        assert qc is None

    def quantize(self, model):
        with torch.no_grad():
            for _, linear in quantizable(model):
                linear.weight.copy_(linear.weight.bfloat16().float())


class HalfWeightsPlugin:
    @hookimpl
    def roseinfer_register_quantization_methods(self, register):
        register("half_weights", HalfWeights)


def test_an_outside_method_serves_a_model(hf, tmp_path):
    path = save(hf, tmp_path)
    reg = PluginRegistry(load_entry_points=False)
    reg.register(HalfWeightsPlugin(), name="half-weights")
    got = ours(path, quantization="half_weights", plugins=reg)
    assert got == reference(with_weights(hf, lambda _, w: w.bfloat16().float()))


def test_a_random_model_is_quantized_one_linear_at_a_time(monkeypatch):
    """Built from a random-weights alias, each linear is quantized as soon as it is
    drawn, before the next exists: the float model is never whole in memory. The
    values are those of the float build, rounded."""
    from roseinfer.models import loader

    seen = []

    class Recording(HalfWeights):
        def quantize(self, module):
            # the linears not yet drawn are still on the meta device
            later = [m for m in pending if m.weight.device.type == "meta"]
            seen.append((type(module).__name__, len(later)))
            super().quantize(module)

    class Plugin:
        @hookimpl
        def roseinfer_register_quantization_methods(self, register):
            register("recording", Recording)

    reg = PluginRegistry(load_entry_points=False)
    reg.register(Plugin(), name="recording")
    meta_module = loader.meta_module

    def keep(hf_config, dtype, plugins, part=None):
        model = meta_module(hf_config, dtype, plugins, part)
        pending[:] = [m for _, m in quantizable(model)]
        return model
    pending = []
    monkeypatch.setattr(loader, "meta_module", keep)
    model, _, _ = loader.load("smollm2-random", quantization="recording", plugins=reg)
    monkeypatch.undo()
    assert seen == [("Linear", n) for n in range(len(pending) - 1, -1, -1)]
    float_model, _, _ = loader.load("smollm2-random")
    for (name, a), (_, b) in zip(quantizable(model), quantizable(float_model)):
        assert torch.equal(a.weight, b.weight.bfloat16().float()), name


# ---------------------------------------------------------------- FP8 KV cache

def fp8_cache_reference(hf, prompt):
    """transformers' greedy generate through a cache that rounds each key and value to
    e4m3 as it stores them: what an FP8 KV cache of scale 1 holds."""
    from transformers import DynamicCache

    class Fp8Cache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            rounded = [t.to(FP8).to(t.dtype) for t in (k, v)]
            return super().update(*rounded, layer_idx, *args, **kwargs)

    # transformers 5.2x names the argument ``cache``; earlier releases ``past_key_values``
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                      dtype=torch.long), max_new_tokens=STEPS, do_sample=False,
                      eos_token_id=None, pad_token_id=0, **{name: Fp8Cache(config=hf.config)})
    return out[0, len(prompt):].tolist()


def test_fp8_kv_cache_equals_transformers_with_a_rounding_cache():
    hf = tiny_llama()
    shared = list(range(10, 33))
    prompts = PROMPTS + [shared, shared + [40, 41]]  # the prefix cache shares blocks
    want = [fp8_cache_reference(hf, p) for p in prompts]
    with LLM(hf, device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=4,
             num_kv_blocks=96, enable_prefix_cache=True) as llm:
        assert llm.engine.kv_cache.k[0].dtype == FP8
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        # n=2 copies the shared prompt's last block for the second sample (copy-on-write)
        twins = llm.generate([shared], SamplingParams(n=2, max_tokens=STEPS, temperature=0,
                                                      ignore_eos=True))[0]
    assert got == want
    assert [o.token_ids for o in twins] == [want[-2]] * 2
    assert want != [hf_greedy(hf, p, STEPS) for p in prompts], "rounding must show here"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels: the "
                    "interpreter's rounding to e4m3 drops carries (test_kv_append_conformance)")
def test_fp8_kv_cache_through_the_triton_plugins_equals_the_torch_plugins():
    """On a GPU, in float32: the Triton KV append and paged attention over an FP8 cache
    give the tokens that torch_index and torch_sdpa give over one."""
    hf = tiny_llama()
    prompts = PROMPTS + [list(range(10, 60))]
    got = {}
    for name, plugins in {"triton": ("triton_paged", "auto"),
                          "torch": ("torch_sdpa", "torch_index")}.items():
        with LLM(hf, device="cuda", dtype="float32", kv_cache_dtype="fp8", block_size=16,
                 num_kv_blocks=64, attention_backend=plugins[0],
                 kv_append_backend=plugins[1]) as llm:
            got[name] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got["triton"] == got["torch"]


def test_fp8_kv_cache_holds_more_blocks(monkeypatch):
    import psutil
    hf = tiny_llama()
    # the CPU cache's budget is a fraction of the available memory: held still here (it
    # moved between the two engines enough to turn 4.0 into 4.1)
    memory = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory._replace(available=8 << 30))
    blocks = {dtype: LLM(hf, device="cpu", dtype="float32", kv_cache_dtype=dtype,
                         kv_cache_memory_fraction=0.01).engine.kv_cache.scratch_block
              for dtype in ("auto", "fp8")}
    # 1 byte a value against float32's 4
    assert round(blocks["fp8"] / blocks["auto"], 1) == 4.0
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto or fp8"):
        LLM(hf, device="cpu", kv_cache_dtype="int8")


@pytest.mark.parametrize("layout", ["compressed-tensors", "awq", "gptq", "act-order"])
def test_a_quantized_checkpoint_over_two_ranks_equals_one(hf, tmp_path, layout):
    """Each rank cuts the packed parts as the weight (row-parallel layers' scales and
    zeros in whole groups of inputs; act-order's kept whole), then reads its own."""
    if layout in ("awq", "gptq"):
        path, _ = hand_packed(hf, tmp_path, layout)
    elif layout == "act-order":
        path, _ = act_order(hf, tmp_path)
    else:
        path = compressed_tensors_checkpoint(
            hf, tmp_path, "W4A16", "pack-quantized",
            lambda w: w.view(w.shape[0], -1, 128).abs().amax(-1) / 7.5)
    assert ours(path, tensor_parallel_size=2) == ours(path)
