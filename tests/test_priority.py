"""Request priorities (lower runs first, vLLM's meaning): the waiting queue's order, the
victim under KV pressure, and the field through protocol v1 and the gateway."""
import time

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.scheduler import Scheduler
from tests.models import tiny_llama


def first_tokens_order(llm, requests):
    """The order in which ``requests`` ((rid, priority) pairs, added at once) produce
    their first token."""
    engine, order = llm.engine, []
    for rid, priority in requests:
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(
            max_tokens=3, temperature=0, ignore_eos=True, priority=priority))
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    return order


def test_waiting_requests_run_by_priority_then_arrival():
    with LLM(tiny_llama(), device="cpu", dtype="float32", max_num_seqs=1,
             num_kv_blocks=64, cpu_compiled_step="off") as llm:
        assert first_tokens_order(llm, [("a", 0), ("b", 0), ("c", -1), ("d", 5),
                                        ("e", -1)]) == ["c", "e", "a", "b", "d"]
        # equal priorities: arrival order, as without them
        assert first_tokens_order(llm, [(r, 0) for r in "pqrs"]) == list("pqrs")


def test_kv_pressure_preempts_the_lowest_priority_first(monkeypatch):
    victims = []
    preempt = Scheduler._preempt

    def recorded(self, seq):
        victims.append(seq.request_id)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", recorded)
    with LLM(tiny_llama(), device="cpu", dtype="float32", block_size=4, num_kv_blocks=10,
             max_num_seqs=4, enable_prefix_cache=False, cpu_compiled_step="off") as llm:
        params = {rid: SamplingParams(max_tokens=14, temperature=0, ignore_eos=True,
                                      priority=p)
                  for rid, p in (("low", 3), ("high", -2), ("mid", 0))}
        for rid, p in params.items():
            llm.engine.add_request(rid, [9, 8, 7, 6, 5], p)
        done = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = len(out.token_ids)
    assert victims and victims[0] == "low"  # admitted first, preempted first
    assert "high" not in victims
    assert done == {"low": 14, "high": 14, "mid": 14}


def test_priority_is_a_32_bit_integer():
    assert SamplingParams().priority == 0
    for bad in (1.5, "1", 2**31, True):
        with pytest.raises(InvalidRequestError, match="^priority: "):
            SamplingParams(priority=bad)


def test_priority_through_the_protocol_and_the_gateway():
    from roseinfer.frontends.openai.mapping import APIError, chat_call
    from roseinfer.frontends.redis_streams.protocol import encode_request
    from roseinfer.frontends.redis_streams.request_entry import decode_request
    from tests.frontends.test_protocol import as_redis

    assert decode_request("1-0", as_redis(encode_request("x", priority=-3))).params.priority == -3
    assert decode_request("1-0", as_redis({"prompt": "x", "priority": "7"})).params.priority == 7
    messages = [{"role": "user", "content": "hi"}]
    assert chat_call({"messages": messages, "priority": 2}).params["priority"] == 2
    with pytest.raises(APIError) as e:
        chat_call({"messages": messages, "priority": "high"})
    assert e.value.param == "priority"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_batch_gives_a_slot_up_to_a_higher_priority_request(device):
    """One sequence slot, a low-priority request running: a high-priority one arriving
    takes its slot at once, and the low one is recomputed to the same tokens after (on
    CUDA with graphs and the next step launched before the last one's tokens are back)."""
    with LLM(tiny_llama(), device=device, dtype="float32", max_num_seqs=1,
             num_kv_blocks=64, cpu_compiled_step="off") as llm:
        params = lambda p: SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                          priority=p)
        low_alone, high_alone = (o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 8, 7]],
                                                                   params(0)))
        engine, finished = llm.engine, []
        engine.add_request("low", [5, 6, 7, 8], params(5))
        for _ in range(3):
            engine.step()
        engine.add_request("high", [9, 8, 7], params(0))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
                    done[out.request_id] = out.token_ids
        assert finished == ["high", "low"]
        assert engine.stats().num_preemptions >= 1
        assert done == {"low": low_alone, "high": high_alone}


def test_priority_ages_a_request_that_waited_long_enough_runs_first():
    """With 10 ms of aging per priority unit, a priority-5 request that waited 100 ms ranks
    before a priority-0 one arriving then; without the wait it ranks after."""
    with LLM(tiny_llama(), device="cpu", dtype="float32", max_num_seqs=1, num_kv_blocks=64,
             cpu_compiled_step="off", priority_aging_s=0.01) as llm:
        engine, order = llm.engine, []
        params = lambda p: SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                          priority=p)
        engine.add_request("old-low", [5, 6, 7], params(5))
        time.sleep(0.1)
        engine.add_request("new-high", [5, 6, 7], params(0))
        engine.add_request("new-low", [5, 6, 7], params(5))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    order.append(out.request_id)
        assert order == ["old-low", "new-high", "new-low"]


def test_priority_aging_must_be_positive():
    from roseinfer.core.config import ConfigError, EngineConfig
    for bad in (0, -1.0, "10"):
        with pytest.raises(ConfigError, match="priority_aging_s"):
            EngineConfig(priority_aging_s=bad)


def test_background_decodes_sit_out_an_urgent_prefill():
    """A request more urgent than the running ones prefills in steps of its own: the
    less urgent decodes wait a step each (Scheduler._sit_out), and every request still
    ends with all its tokens, as transformers' greedy has them."""
    from tests.models import hf_greedy
    hf = tiny_llama()
    with LLM(hf, device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64,
             cpu_compiled_step="off") as llm:
        engine, steps = llm.engine, []
        schedule = engine.scheduler.schedule

        def recorded():
            batch = schedule()
            steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
            return batch
        engine.scheduler.schedule = recorded
        greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
        for rid in ("bg1", "bg2"):
            engine.add_request(rid, [5, 6, 7, 8], SamplingParams(priority=5, **greedy))
        outs = {}
        for i in range(30):
            if i == 3:
                engine.add_request("chat", [9, 8, 7, 6, 5, 4], SamplingParams(**greedy))
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
            if not engine.has_unfinished():
                break
    (first,) = [s for s in steps if ("chat", 6) in s]
    assert first == [("chat", 6)]  # the background decodes sat it out
    assert any(("bg1", 1) in s and ("chat", 1) in s for s in steps)  # then all decode
    assert outs == {"bg1": hf_greedy(hf, [5, 6, 7, 8], 8), "bg2": hf_greedy(hf, [5, 6, 7, 8], 8),
                    "chat": hf_greedy(hf, [9, 8, 7, 6, 5, 4], 8)}
