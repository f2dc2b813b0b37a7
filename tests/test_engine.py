"""Engine behaviour: preemption, abort, sampling, stop conditions, bad input."""
import dataclasses

import pytest
import torch

from roseinfer import LLM, EngineConfig, SamplingParams
from roseinfer.core.errors import ConfigError, InvalidRequestError
from tests.models import hf_greedy
from tests.test_greedy_equality import mixed_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def llm_for(hf, **config):
    return LLM(hf, **{"device": "cpu", "block_size": 4, "num_kv_blocks": 128, **config})


def test_preemption_under_a_tiny_pool_keeps_greedy_outputs(gpt2_model):
    prompts = mixed_prompts(6, seed=5)
    # 48 slots for ~6 x 30 tokens; decode windows on, so they reserve blocks ahead too
    llm = llm_for(gpt2_model, num_kv_blocks=12, decode_steps_min_seqs=1)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0, "the pool should have forced preemption"
    assert [o.token_ids for o in outs] == [hf_greedy(gpt2_model, p, 16) for p in prompts]
    assert llm.engine.blocks.num_free == 12


def test_abort_frees_blocks_and_reports_abort(gpt2_model):
    llm = llm_for(gpt2_model)
    eng = llm.engine
    eng.add_request("a", [3, 4, 5, 6, 7], GREEDY)
    eng.add_request("b", [8, 9], GREEDY)
    eng.step()
    eng.step()
    assert eng.blocks.num_free < 128
    eng.abort("a")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free == 128 and eng.num_unfinished() == 0


def test_seeded_sampling_is_independent_of_the_batch(gpt2_model):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = llm_for(gpt2_model).generate([[5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 3
    mixed = llm_for(gpt2_model).generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]],
                                         [others[0], params, others[1]])
    assert mixed[1].token_ids == alone
    again = llm_for(gpt2_model).generate([[5, 6, 7]], params)[0].token_ids
    assert again == alone


def test_top_k_one_is_greedy(gpt2_model):
    params = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True)
    out = llm_for(gpt2_model).generate([[11, 12]], params)[0]
    assert out.token_ids == hf_greedy(gpt2_model, [11, 12], 10)


def test_min_p_one_is_greedy(gpt2_model):
    params = SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, ignore_eos=True)
    out = llm_for(gpt2_model).generate([[13, 14]], params)[0]
    assert out.token_ids == hf_greedy(gpt2_model, [13, 14], 10)


def test_sampling_follows_the_distribution():
    """Empirical frequencies of the sampler match softmax(logits / T) after top-p."""
    from roseinfer.core.sampler import Sampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    p = SamplingParams(temperature=0.5, top_p=0.9)
    torch.manual_seed(0)
    picks = Sampler()(logits, [p] * 20000, [None] * 20000)
    freq = torch.bincount(picks, minlength=4).float() / 20000
    probs = torch.softmax(logits[0] / 0.5, dim=-1)   # [0.867, 0.117, 0.016, 0.002]
    kept = probs[:2] / probs[:2].sum()                # top-p 0.9 keeps two tokens
    assert torch.allclose(freq[:2], kept, atol=0.01) and freq[2:].sum() == 0


def test_stop_token_ids_and_eos(gpt2_model):
    ref = hf_greedy(gpt2_model, [20, 21], 16)
    llm = llm_for(gpt2_model)
    out = llm.generate([[20, 21]], SamplingParams(max_tokens=16, temperature=0,
                                                  stop_token_ids=[ref[3]]))[0]
    assert out.token_ids == ref[:ref.index(ref[3]) + 1] and out.finish_reason == "stop"
    eos = llm.engine.eos_ids
    first_eos = next((i for i, t in enumerate(ref) if t in eos), None)
    out = llm.generate([[20, 21]], SamplingParams(max_tokens=16, temperature=0))[0]
    expected = ref if first_eos is None else ref[:first_eos + 1]
    assert out.token_ids == expected


def test_decode_windows_stream_groups_of_tokens(gpt2_model):
    """After the prefill step, decode runs in windows of decode_steps tokens,
    shortened so that no request passes max_tokens."""
    eng = llm_for(gpt2_model, decode_steps=4, decode_steps_min_seqs=1).engine
    eng.add_request("a", [20, 21], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    chunks, ids = [], []
    while eng.has_unfinished():
        for out in eng.step():
            chunks.append(len(out.new_token_ids))
            ids += out.new_token_ids
    assert chunks == [1, 4, 4, 1]
    assert ids == hf_greedy(gpt2_model, [20, 21], 10)


def test_small_batches_step_one_token_at_a_time(gpt2_model):
    eng = llm_for(gpt2_model, decode_steps=4, decode_steps_min_seqs=2).engine
    eng.add_request("a", [20, 21], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    chunks = []
    while eng.has_unfinished():
        chunks += [len(out.new_token_ids) for out in eng.step()]
    assert chunks == [1] * 5


@pytest.mark.parametrize("priority, chunks", [(0, [[1, 5]] * 4 + [[1, 2]]),
                                               (1, [[1, 5]] * 4 + [[1, 2]]), (-1, [[22]])])
def test_prefill_beside_decoding_sequences_is_capped(gpt2_model, priority, chunks):
    """A prompt prefills in one step alone, and in chunks of at most
    max_mixed_prefill_tokens while another sequence decodes, unless it is more urgent
    than the sequence decoding (a lower priority value): then in one step, which the
    less urgent decode sits out (Scheduler._sit_out)."""
    eng = llm_for(gpt2_model, max_num_batched_tokens=64, max_mixed_prefill_tokens=5).engine
    batches, schedule = [], eng.scheduler.schedule

    def spy():
        batch = schedule()
        batches.append(list(batch.num_tokens))
        return batch
    eng.scheduler.schedule = spy
    first, second = list(range(10, 30)), list(range(40, 62))
    eng.add_request("a", first, GREEDY)
    ids = {"a": [], "b": []}
    for i in range(14):
        if i == 1:
            eng.add_request("b", second, dataclasses.replace(GREEDY, priority=priority))
        for out in eng.step():
            ids[out.request_id] += out.new_token_ids
    while eng.has_unfinished():
        for out in eng.step():
            ids[out.request_id] += out.new_token_ids
    assert batches[0] == [20]
    assert [b for b in batches[1:] if max(b, default=0) > 1] == chunks
    assert ids == {"a": hf_greedy(gpt2_model, first, 16), "b": hf_greedy(gpt2_model, second, 16)}


def test_tokens_are_recorded_at_a_device_side_window_step(gpt2_model):
    """CUDA graphs record at a window step held in a tensor; the host at an int."""
    runner = llm_for(gpt2_model, decode_steps=4).engine.runner
    runner._record(torch.tensor([2], dtype=torch.int32), torch.tensor([7, 8, 9]))
    runner._record(1, torch.tensor([4, 5]))
    assert runner.window[2, :3].tolist() == [7, 8, 9] and runner.window[1, :2].tolist() == [4, 5]
    assert runner.sampled[:3].tolist() == [4, 5, 9]


def test_stop_mid_window_drops_the_rest_of_the_window(gpt2_model):
    ref = hf_greedy(gpt2_model, [30, 31], 16)
    stop = ref[3]  # the third token of the first window (the prefill step made ref[0])
    eng = llm_for(gpt2_model, decode_steps=8, decode_steps_min_seqs=1).engine
    eng.add_request("a", [30, 31], SamplingParams(max_tokens=16, temperature=0,
                                                  stop_token_ids=[stop], ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert sum((o.new_token_ids for o in outs), []) == ref[:ref.index(stop) + 1]
    assert outs[-1].finish_reason == "stop" and eng.blocks.num_free == 128


def test_max_tokens_and_model_context(gpt2_model):
    out = llm_for(gpt2_model).generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0,
                                                               ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    llm = llm_for(gpt2_model, max_model_len=10)
    out = llm.generate([[1, 2, 3, 4]], GREEDY)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -1}),
    ("min_p", {"min_p": 2.0}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_bad_prompts_name_the_field(gpt2_model):
    eng = llm_for(gpt2_model, max_model_len=32).engine
    with pytest.raises(InvalidRequestError, match="prompt") as e:
        eng.add_request("r1", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        eng.add_request("r2", [1, 512], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        eng.add_request("r3", [1, -1], GREEDY)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("r4", list(range(40)), GREEDY)
    assert e.value.code == "too_long"
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        eng.add_request("r5", "text", GREEDY)
    assert not eng.has_unfinished()


def test_bad_config_is_refused(gpt2_model):
    with pytest.raises(ValueError, match="registered: .*torch_index.*Is the plugin installed"):
        llm_for(gpt2_model, kv_append_backend="nope")
    with pytest.raises(ValueError, match="registered: .*arrays"):
        llm_for(gpt2_model, metadata_store="nope")
    with pytest.raises(ConfigError, match="unknown engine option"):
        llm_for(gpt2_model, blok_size=4)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="decode_steps"):
        EngineConfig(decode_steps=0)


def test_config_from_toml(tmp_path):
    path = tmp_path / "roseinfer.toml"
    path.write_text('[engine]\nblock_size = 8\nmetadata_store = "arrays"\n')
    cfg = EngineConfig.from_toml(str(path), max_num_seqs=3)
    assert (cfg.block_size, cfg.metadata_store, cfg.max_num_seqs) == (8, "arrays", 3)


def test_resume_with_emitted_ids_continues_without_repeats(gpt2_model):
    full = hf_greedy(gpt2_model, [3, 1, 4, 1, 5], 10)
    eng = llm_for(gpt2_model).engine
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eng.add_request("r", [3, 1, 4, 1, 5], params, emitted_ids=full[:4])
    new = []
    while eng.has_unfinished():
        for out in eng.step():
            new += out.new_token_ids
    assert new == full[4:]
    with pytest.raises(InvalidRequestError, match="emitted_ids"):
        eng.add_request("s", [1], params, emitted_ids=[1, 600])


def test_resumed_text_continues_the_stream():
    """Through a real tokenizer: the resumed text is exactly the rest of the text."""
    from transformers import GPT2LMHeadModel, GPT2Config

    from roseinfer.models.loader import CACHE_DIR
    from roseinfer.models.tokenizers import gpt2_tokenizer

    tok = gpt2_tokenizer(CACHE_DIR)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128,
                                    initializer_range=0.3)).eval()
    llm = LLM(hf, tokenizer=tok, device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    whole = llm.generate(["Once upon a time"], params)[0]
    eng = llm.engine
    eng.add_request("r", "Once upon a time", params, emitted_ids=whole.token_ids[:5])
    rest = ""
    while eng.has_unfinished():
        rest += "".join(o.new_text for o in eng.step())
    assert tok.decode(whole.token_ids[:5]) + rest == whole.text


def test_packed_inputs_do_not_overlap():
    import numpy as np

    from roseinfer.core.step_inputs import views

    buf = np.full(200, -7, dtype=np.int32)
    host = views(buf, 6, 4, 3)
    for i, name in enumerate(sorted(host.fields)):
        host.fields[name][:] = i
    used = buf[:host.total]
    assert (buf[host.total:] == -7).all()
    assert sorted(np.unique(used).tolist()) == list(range(len(host.fields)))
    assert sum(len(v) for v in host.fields.values()) == host.total


def test_resume_releases_text_the_first_owner_held_back():
    """A stop string longer than the text makes the first owner hold text back;
    the resuming engine must hand it out, not lose it."""
    from transformers import GPT2LMHeadModel, GPT2Config

    from roseinfer.models.loader import CACHE_DIR
    from roseinfer.models.tokenizers import gpt2_tokenizer

    tok = gpt2_tokenizer(CACHE_DIR)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128,
                                    initializer_range=0.3)).eval()
    llm = LLM(hf, tokenizer=tok, device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            stop=["never-appears-in-this-text"])
    whole = llm.generate(["Once upon a time"], params)[0]
    eng = llm.engine
    eng.add_request("first", "Once upon a time", params)
    handed_out, ids = "", []
    while len(ids) < 5:
        for out in eng.step():
            ids += out.new_token_ids
            handed_out += out.new_text
    eng.abort("first")
    eng.step()
    eng.add_request("r", "Once upon a time", params, emitted_ids=ids, emitted_text=handed_out)
    rest = ""
    while eng.has_unfinished():
        rest += "".join(o.new_text for o in eng.step())
    assert handed_out + rest == whole.text


def test_the_backlog_counts_prompt_tokens_ahead_and_steps_to_a_free_seat(gpt2_model):
    """What a fleet's router predicts a request's wait from (frontends/redis_streams/
    routing.py): prompt tokens not computed yet, and with every seat taken, the steps
    until the nearest running sequence reaches its length limit."""
    eng = llm_for(gpt2_model, max_num_seqs=2, decode_steps=1).engine
    s = eng.scheduler
    assert s.backlog() == (0, 0)
    for rid, n, new in (("a", 7, 5), ("b", 5, 9), ("c", 9, 3)):
        eng.add_request(rid, list(range(10, 10 + n)), SamplingParams(
            max_tokens=new, temperature=0, ignore_eos=True))
    assert s.backlog() == (21, 0)
    eng.step_times.take()
    eng.step()  # a and b take both seats and compute their prompts; c waits
    tokens, steps = s.backlog()
    assert tokens == 9 and steps == 5 - 1  # a's first token is in flight
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert s.backlog() == (0, 0)
    prompts = [tokens for tokens, _ in eng.step_times.take()]
    # c's 9 in a later step, less the block of 4 it shares with a, cached by then
    assert prompts[0] == 12 and sum(prompts) == 12 + 5
    # a prompt whose first two blocks of 4 the prefix cache holds: 3 tokens to compute
    history = list(range(10, 17)) + done["a"].token_ids
    eng.add_request("d", history[:8] + [1, 2, 3], GREEDY)
    assert s.backlog() == (3, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the host runs ahead of it")
def test_a_prompt_of_many_chunks_while_the_gpu_lags(llama_model, monkeypatch):
    """A prompt's chunks sample nothing, so nothing waits for them to land; each is still
    waited for before the step after next refills its host input buffer. A sleep kernel
    before every step makes the GPU lag, so the host runs as far ahead as it may."""
    llm = LLM(llama_model, device="cuda", dtype="float32", block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=16, max_num_seqs=2)
    launch = llm.engine.runner.launch

    def lagging(*args, **kwargs):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds of GPU time
        return launch(*args, **kwargs)
    monkeypatch.setattr(llm.engine.runner, "launch", lagging)
    prompt = [(7 * i) % 500 + 2 for i in range(200)]  # 13 chunks of 16 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(llama_model, prompt, 8)


def test_a_max_model_len_past_the_models_context_is_refused(gpt2_model):
    """GPT-2's learned positions end at n_positions, as RoPE tables end at
    max_position_embeddings: a longer max_model_len would read past them."""
    positions = gpt2_model.config.n_positions
    with pytest.raises(ConfigError, match=f"more than the model's context of {positions}"):
        llm_for(gpt2_model, max_model_len=positions + 1)
    assert llm_for(gpt2_model, max_model_len=positions).engine.max_model_len == positions
