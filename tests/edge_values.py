"""Hypothesis strategies: each request field at the edges of what its type allows."""
import math

from hypothesis import strategies as st

# msgpack carries integers in [-2**63, 2**64); the Python API takes any.
EDGE_INTS = [0, 1, -1, 2**15, 2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63,
             2**64 - 1, -2**31 - 1, -2**63]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-30, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e4, 1e4 + 1,
               3.4e38, 3.5e38, 1e300, math.inf, -math.inf, math.nan]


def ints():
    return st.sampled_from(EDGE_INTS) | st.integers(-2**63, 2**64 - 1)


def numbers():
    return st.sampled_from(EDGE_FLOATS) | ints() | st.floats()


def anything():
    return st.none() | st.booleans() | ints() | numbers() | st.text(max_size=8)


FIELDS = {
    "n": ints(), "max_tokens": ints(), "temperature": numbers(), "top_p": numbers(),
    "top_k": ints(), "min_p": numbers(), "seed": ints() | st.none(),
    "stop": st.lists(st.text(max_size=40), max_size=20) | anything(),
    "stop_token_ids": st.lists(ints(), max_size=20) | anything(),
    "ignore_eos": anything(), "logprobs": ints() | st.none(),
    "prompt_logprobs": ints() | st.none(), "repetition_penalty": numbers(),
    "frequency_penalty": numbers(), "presence_penalty": numbers(),
    "logit_bias": st.dictionaries(ints(), numbers(), max_size=4) | anything(),
}


def edge_params():
    """One to three fields of SamplingParams, each at an edge value."""
    return st.dictionaries(st.sampled_from(sorted(FIELDS)), st.just(None), min_size=1,
                           max_size=3).flatmap(
        lambda picked: st.fixed_dictionaries({k: FIELDS[k] for k in picked}))
