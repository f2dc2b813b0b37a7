"""Every field at its edges through LLM.generate: each request ends with tokens or is
refused by name, and its batch-mate's tokens do not change."""
from hypothesis import HealthCheck, example, given, settings

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.sample_kernel import words
from tests.edge_values import edge_params
from tests.models import tiny_llama

MATE = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LLM_ = LLM(tiny_llama(), device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=20)
CLEAN = LLM_.generate([[6, 7, 8]], MATE)[0].token_ids


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(edge=edge_params())
@example(edge={"stop_token_ids": ""})  # a string passed the element check, then broke a step
def test_each_field_at_its_edges(edge):
    try:
        params = SamplingParams(**edge)
    except InvalidRequestError as e:
        assert e.field in edge
        return
    except TypeError:  # a value of the wrong type in a list or map, refused as Python does
        return
    try:
        outs = LLM_.generate([[3, 4, 5], [6, 7, 8]], [params, MATE])
    except InvalidRequestError as e:
        assert e.field in edge or e.field in ("prompt", "logit_bias")
        assert not LLM_.engine.has_unfinished()
        return
    edge_outs = outs[0] if isinstance(outs[0], list) else [outs[0]]
    assert all(o.finish_reason in ("stop", "length") for o in edge_outs), edge
    assert outs[1].token_ids == CLEAN, edge
    assert all(-2**31 <= w < 2**31 for w in words(params))  # what the step's int32 rows hold
