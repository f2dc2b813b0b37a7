"""Plugin registration, selection by name, outside plugins, the plugins command."""
import os

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.plugins import PluginRegistry, UnknownPluginError
from roseinfer.plugins.kv_append.torch_index import TorchIndexAppend
from roseinfer.plugins.metadata.arrays import ArraysStore
from tests.models import hf_greedy


class CountingAppend(TorchIndexAppend):
    calls = 0

    def append(self, *args):
        CountingAppend.calls += 1
        super().append(*args)


class CountingStore(ArraysStore):
    created = 0

    def __init__(self, *args):
        CountingStore.created += 1
        super().__init__(*args)


class OutsidePlugin:
    @hookimpl
    def roseinfer_register_kv_append_backends(self, register):
        register("counting", CountingAppend)

    @hookimpl
    def roseinfer_register_metadata_stores(self, register):
        register("counting_store", CountingStore)


def test_builtins_are_registered_by_name():
    reg = PluginRegistry(load_entry_points=False)
    assert {"torch_index", "triton_generic", "triton_identity_pos", "triton_full_batch"} <= set(
        reg.names("kv_append"))
    assert {"slots", "arrays"} <= set(reg.names("metadata"))
    assert "torch_sdpa" in reg.names("attention")
    assert {"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3"} <= set(reg.names("model"))
    assert "xgrammar" in reg.names("logits_processor")


def test_outside_plugin_is_selected_and_called(gpt2_model):
    reg = PluginRegistry(load_entry_points=False)
    reg.register(OutsidePlugin(), name="outside")
    assert reg.get("kv_append", "counting").origin == "outside"
    llm = LLM(gpt2_model, plugins=reg, device="cpu", block_size=4, num_kv_blocks=64,
              kv_append_backend="counting", metadata_store="counting_store")
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(gpt2_model, [4, 5, 6], 5)
    assert CountingAppend.calls == 5 * gpt2_model.config.n_layer  # one per step per layer
    assert CountingStore.created == 1


def test_duplicate_names_are_refused():
    reg = PluginRegistry(load_entry_points=False)

    class Dup:
        @hookimpl
        def roseinfer_register_kv_append_backends(self, register):
            register("torch_index", CountingAppend)

    reg.register(Dup(), name="dup")
    with pytest.raises(ValueError, match="registered twice"):
        reg.names("kv_append")


def test_unknown_name_lists_registered():
    with pytest.raises(UnknownPluginError, match="registered: .*slots.*Is the plugin installed"):
        PluginRegistry(load_entry_points=False).get("metadata", "nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton loads wherever CUDA is")
def test_a_triton_backend_named_on_a_cpu_machine_says_where_it_runs():
    """Without CUDA and the interpreter Triton is not imported (0.3 s of every start),
    so its plugins are not registered: the error says why, at engine build."""
    import subprocess
    import sys

    code = ("from roseinfer import LLM; from tests.models import tiny_llama\n"
            "try:\n    LLM(tiny_llama(), device='cpu', attention_backend='triton_paged')\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert "UnknownPluginError unknown attention plugin 'triton_paged'; registered: " \
           "torch_sdpa. Triton's plugins load only where their kernels run" in out.stdout, \
        out.stderr[-2000:]


def test_plugins_command_lists_everything(capsys):
    from roseinfer.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("torch_index", "triton_full_batch", "slots", "arrays", "torch_sdpa", "qwen3"):
        assert name in out


def test_an_outside_model_architecture_serves_its_model_type(gpt2_model):
    """A third-party family: its model_type picks its module, which runs the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from roseinfer.models.gpt2 import GPT2ForCausalLM

    class MyConfig(GPT2Config):
        model_type = "my-gpt2"

    class MyModel(GPT2ForCausalLM):
        built = 0

        def __init__(self, cfg):
            MyModel.built += 1
            super().__init__(cfg)

    class Family:
        @hookimpl
        def roseinfer_register_model_architectures(self, register):
            register("my-gpt2", MyModel)

    fields = {k: v for k, v in gpt2_model.config.to_diff_dict().items() if k != "model_type"}
    hf = GPT2LMHeadModel(MyConfig(**fields)).eval()
    hf.load_state_dict(gpt2_model.state_dict())
    with pytest.raises(ValueError, match="'my-gpt2' is not supported; supported: .*gpt2.*"
                                         "roseinfer_register_model_architectures"):
        LLM(hf, plugins=PluginRegistry(load_entry_points=False), device="cpu")
    reg = PluginRegistry(load_entry_points=False)
    reg.register(Family(), name="family")
    llm = LLM(hf, plugins=reg, device="cpu", block_size=4, num_kv_blocks=64)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert MyModel.built == 1
    assert out[0].token_ids == hf_greedy(gpt2_model, [4, 5, 6], 5)
