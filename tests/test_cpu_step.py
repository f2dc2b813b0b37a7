"""The compiled one-sequence CPU decode step (core/cpu_step.py): the same greedy ids as
transformers, built once and reused, and used only where it applies and pays."""
import json

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core import cpu_step
from roseinfer.core.errors import ConfigError
from roseinfer.models import loader
from tests.models import hf_greedy, tiny_family, tiny_gpt2, tiny_llama
from tests.test_cpu_weights import needs_bf16

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU path")

MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "qwen3": lambda: tiny_family("qwen3"),
          "phi3": lambda: tiny_family("phi3", sliding_window=None, rope_parameters={
              "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})}
PROMPTS = [[5, 6, 7], list(range(10, 33))]  # contexts cross blocks of 4 from both
CONFIG = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def loaded_pays(monkeypatch):
    """A tiny model's step takes 0.1-3 ms either way, where a thread's wake-up can
    decide: these tests check what the step computes, test_a_step_slower_than_eager_
    is_not_used the timing rule."""
    monkeypatch.setattr(cpu_step, "_pays", lambda record: record["compiled_ms"] is not None)


def skip_if_torch_crashed(cache_dir):
    """torch's own loader ended the build's probe with a signal: a torch bug on this
    machine (seen with torch 2.11 on an Intel Xeon), not this code's."""
    (record,) = (cache_dir / "cpu_steps").glob("*.json")
    failed = json.loads(record.read_text()).get("failed", "")
    if "ended its process with code -" in failed:
        pytest.skip(f"torch cannot load AOTInductor packages here: {failed}")


def greedy(llm, prompts, max_tokens=(14, 14)):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    return [o.token_ids for o in llm.generate(prompts, params[:len(prompts)])]


@pytest.mark.parametrize("family", MODELS)
def test_built_step_decodes_as_transformers(family, cache_dir, loaded_pays):
    hf = MODELS[family]()
    llm = LLM(hf, cpu_compiled_step="build", **CONFIG)
    compiled = llm.engine.runner.compiled
    if compiled is None:
        skip_if_torch_crashed(cache_dir)
    assert compiled is not None
    for prompt in PROMPTS:  # one sequence at a time: every decode step runs compiled
        assert greedy(llm, [prompt]) == [hf_greedy(hf, prompt, 14)]
    assert compiled.steps == 2 * 13
    # Two sequences decode eagerly together, then the longer one alone, compiled.
    both = greedy(llm, PROMPTS, (6, 20))
    assert both == [hf_greedy(hf, PROMPTS[0], 6), hf_greedy(hf, PROMPTS[1], 20)]
    assert compiled.steps > 2 * 13


def test_auto_uses_a_build_and_never_builds(cache_dir, loaded_pays, monkeypatch):
    hf = tiny_llama()
    built = LLM(hf, cpu_compiled_step="build", **CONFIG).engine.runner.compiled
    monkeypatch.setattr(cpu_step, "build", lambda *a: pytest.fail("auto must not build"))
    llm = LLM(hf, **CONFIG)  # "auto" is the default
    assert llm.engine.runner.compiled is not None and built is not None
    assert greedy(llm, [PROMPTS[1]]) == [hf_greedy(hf, PROMPTS[1], 14)]
    steps = llm.engine.runner.compiled.steps
    assert greedy(llm, [[5]]) == [hf_greedy(hf, [5], 14)]  # its prefill's context of 1: eager
    assert llm.engine.runner.compiled.steps == steps + 13
    assert LLM(hf, cpu_compiled_step="off", **CONFIG).engine.runner.compiled is None
    other = tiny_llama(rms_norm_eps=1e-3)  # its epsilon is compiled in: another key
    assert LLM(other, **CONFIG).engine.runner.compiled is None


def test_a_step_slower_than_eager_is_not_used(cache_dir):
    hf = tiny_gpt2()
    LLM(hf, cpu_compiled_step="build", **CONFIG)
    (record,) = (cache_dir / "cpu_steps").glob("*.json")
    found = json.loads(record.read_text())
    record.write_text(json.dumps({**found, "compiled_ms": found["eager_ms"] * 2}))
    assert LLM(hf, **CONFIG).engine.runner.compiled is None


@pytest.mark.parametrize("weights", [pytest.param("bfloat16", marks=needs_bf16), "int8"])
def test_rounded_weights_decode_compiled_as_eager(weights, cache_dir, loaded_pays):
    """bfloat16 and int8 linear weights (layers/cpu_weights.py) compiled: the eager
    step's ids with the same weights."""
    hf = tiny_llama()
    llm = LLM(hf, cpu_compiled_step="build", cpu_weight_dtype=weights, **CONFIG)
    compiled = llm.engine.runner.compiled
    if compiled is None:
        skip_if_torch_crashed(cache_dir)
    eager = LLM(hf, cpu_compiled_step="off", cpu_weight_dtype=weights, **CONFIG)
    for prompt in PROMPTS:
        assert greedy(llm, [prompt]) == greedy(eager, [prompt])
    assert compiled.steps == 2 * 13


def test_build_is_refused_where_it_does_not_apply(cache_dir):
    with pytest.raises(ConfigError, match="cpu_compiled_step build applies to"):
        LLM(tiny_gpt2(), cpu_compiled_step="build", kv_cache_dtype="fp8", **CONFIG)
    with pytest.raises(ConfigError, match="cpu_compiled_step must be"):
        LLM(tiny_gpt2(), cpu_compiled_step="always", **CONFIG)
    assert not (cache_dir / "cpu_steps").exists()


def test_a_package_torch_cannot_load_is_recorded_and_not_used(cache_dir, tmp_path, monkeypatch):
    broken = tmp_path / "broken.pt2"
    broken.write_bytes(b"not a package")
    assert "loading the package ended its process with code" in cpu_step._load_fails(broken)
    hf = tiny_gpt2()
    monkeypatch.setattr(cpu_step, "_load_fails",
                        lambda path, preload="": "the loader crashed (code -11)")
    assert LLM(hf, cpu_compiled_step="build", **CONFIG).engine.runner.compiled is None
    (record,) = (cache_dir / "cpu_steps").glob("*.json")
    assert json.loads(record.read_text())["failed"] == "the loader crashed (code -11)"
    assert not list((cache_dir / "cpu_steps").glob("*.pt2"))
    monkeypatch.setattr(cpu_step, "build", lambda *a: pytest.fail("recorded: no second build"))
    assert LLM(hf, cpu_compiled_step="build", **CONFIG).engine.runner.compiled is None


def test_a_damaged_or_missing_package_leaves_the_start_eager(cache_dir, loaded_pays):
    hf = tiny_gpt2()
    LLM(hf, cpu_compiled_step="build", **CONFIG)
    (package,) = (cache_dir / "cpu_steps").glob("*.pt2")
    package.write_bytes(b"damaged")
    llm = LLM(hf, **CONFIG)
    assert llm.engine.runner.compiled is None
    assert greedy(llm, [PROMPTS[0]]) == [hf_greedy(hf, PROMPTS[0], 14)]
    package.unlink()  # then "build" builds it again
    assert LLM(hf, cpu_compiled_step="build", **CONFIG).engine.runner.compiled is not None


@pytest.fixture
def saved_llama(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path / "model")
    return hf, str(tmp_path / "model")


def test_auto_builds_in_the_background_and_swaps_between_requests(
        cache_dir, loaded_pays, saved_llama, monkeypatch):
    monkeypatch.delenv("ROSEINFER_BACKGROUND_BUILDS")
    hf, path = saved_llama
    llm = LLM(path, **CONFIG)  # "auto": nothing built yet
    engine = llm.engine
    assert engine.runner.compiled is None and engine.step_choice.background is None
    assert greedy(llm, [PROMPTS[1]]) == [hf_greedy(hf, PROMPTS[1], 14)]  # eager
    assert engine.step_choice.background is not None  # started once the first answer is out
    assert greedy(llm, [PROMPTS[0]]) == [hf_greedy(hf, PROMPTS[0], 14)]  # eager meanwhile
    build = engine.step_choice.background
    assert build.proc.wait(timeout=600) == 0, \
        (cache_dir / "cpu_steps").joinpath(build.path.name + ".log").read_text()
    assert engine.step() == []  # no request runs: the build is swapped in here
    if engine.runner.compiled is None:
        skip_if_torch_crashed(cache_dir)
    assert engine.runner.compiled is not None and engine.step_choice.background is None
    for prompt in PROMPTS:  # the same tokens, now from the compiled step
        assert greedy(llm, [prompt]) == [hf_greedy(hf, prompt, 14)]
    assert engine.runner.compiled.steps == 2 * 13
    again = LLM(path, **CONFIG).engine  # a second start reuses the build
    assert again.runner.compiled is not None and again.step_choice.to_build is None


def test_a_build_that_fails_in_the_child_leaves_the_engine_eager(
        cache_dir, saved_llama, monkeypatch):
    monkeypatch.delenv("ROSEINFER_BACKGROUND_BUILDS")
    monkeypatch.setattr(cpu_step.sys, "executable", "false")  # the child exits at once
    hf, path = saved_llama
    llm = LLM(path, **CONFIG)
    assert greedy(llm, [PROMPTS[0]]) == [hf_greedy(hf, PROMPTS[0], 14)]
    assert llm.engine.step_choice.background.proc.wait(timeout=60) != 0
    assert greedy(llm, [PROMPTS[1]]) == [hf_greedy(hf, PROMPTS[1], 14)]
    assert llm.engine.runner.compiled is None and llm.engine.step_choice.background is None
    # It left no record, so the next start tries again: its lock names a dead process.
    again = LLM(path, **CONFIG)
    greedy(again, [PROMPTS[0]])
    assert again.engine.step_choice.background is not None
