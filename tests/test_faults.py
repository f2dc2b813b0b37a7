"""A step that raises costs only the request that made it raise (core/faults.py)."""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.faults import EngineBroken
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.plugins import PluginRegistry
from tests.conftest import DEVICE

PROMPTS = [[3 + i, 40 + 7 * i, 9 + i] for i in range(16)]
BAD = 5  # the index of the request that raises


class Fuse:
    """An outside logits processor with a bug: it raises once its sequence has taken
    ``after`` tokens, in ``apply`` (inside the batch's step) or in ``accept`` (its own
    host work)."""

    def __init__(self, ctx):
        pass

    def start(self, args, prompt_ids):
        return FuseState(args["after"], args["where"])

    def apply(self, logits, rows, states):
        for state in states:
            if state.where == "apply" and state.seen >= state.after:
                raise RuntimeError("the fuse blew in apply")


class FuseState:
    def __init__(self, after, where):
        self.after, self.where, self.seen = after, where, 0

    def accept(self, token_ids):
        self.seen += len(token_ids)
        if self.where == "accept" and self.seen >= self.after:
            raise RuntimeError("the fuse blew in accept")


class FusePlugin:
    @hookimpl
    def roseinfer_register_logits_processors(self, register):
        register("fuse", Fuse)


def fused_llm(model, **config):
    """float32 on CUDA too: the others' tokens are compared with a clean run's, and a
    failed step's bisection (or a request that leaves) changes the batch that each row
    runs in; in bf16 that alone moved a greedy token of the random tiny model on an H100."""
    reg = PluginRegistry(load_entry_points=False)
    reg.register(FusePlugin(), name="fuse")
    return LLM(model, plugins=reg, device=DEVICE, dtype="float32", num_kv_blocks=96,
               block_size=8, max_num_seqs=16, **config)


def params(i, fuse=None):
    seeded = DEVICE == "cuda" and i % 2  # the GPU's noise is keyed by seed and position
    p = dict(max_tokens=12, ignore_eos=True, temperature=0.8 if seeded else 0, seed=i)
    if fuse is not None:
        p["logits_processors"] = {"fuse": fuse}
    return SamplingParams(**p)


@pytest.mark.parametrize("where", ["apply", "accept"])
@pytest.mark.parametrize("graphs", [False, True] if DEVICE == "cuda" else [False])
def test_one_failing_request_of_sixteen_fails_alone(llama_model, where, graphs, caplog):
    llm = fused_llm(llama_model, cuda_graphs=graphs)
    clean = llm.generate(PROMPTS, [params(i) for i in range(16)])
    fuse = {"after": 4, "where": where}
    outs = llm.generate(PROMPTS, [params(i, fuse if i == BAD else None) for i in range(16)])
    # apply raises inside the batch's step, which is then bisected; accept raises on
    # the host, in the step (a token taken early, core/processors.py) or after it
    if where == "apply":
        assert any("event=step_failed" in r.getMessage() for r in caplog.records)
    bad = outs[BAD]
    assert bad.finish_reason == "error" and "the fuse blew" in bad.error
    assert bad.error.startswith("RuntimeError")
    for i, (out, ref) in enumerate(zip(outs, clean)):
        if i != BAD:
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == ref.token_ids, i
    assert not llm.engine.has_unfinished() and llm.engine.blocks.usage() == 0
    again = llm.generate(PROMPTS[:3], [params(i) for i in range(3)])  # the engine goes on
    assert [o.token_ids for o in again] == [o.token_ids for o in clean[:3]]


def test_every_sample_of_a_failing_request_ends(llama_model):
    llm = fused_llm(llama_model)
    fuse = {"after": 3, "where": "apply"}
    outs = llm.generate(PROMPTS[:3], [params(0), SamplingParams(
        n=3, max_tokens=8, temperature=0.7, logits_processors={"fuse": fuse}), params(2)])
    assert [o.finish_reason for o in outs[1]] == ["error"] * 3
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert not llm.engine.has_unfinished()


def test_a_broken_engine_fails_nobody(llama_model, monkeypatch):
    llm = fused_llm(llama_model)
    for i in range(4):
        llm.engine.add_request(f"r{i}", PROMPTS[i], params(i))

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.engine.runner, "launch", broken)
    with pytest.raises(EngineBroken, match="device is gone"):
        llm.engine.step()
    assert llm.engine.num_unfinished() == 4  # nobody failed: all wait to be served again
    assert all(s.status.value == "waiting" and not s.block_table for s in llm.engine.seqs.values())
    monkeypatch.undo()
    outs = []
    while llm.engine.has_unfinished():
        outs += [o for o in llm.engine.step() if o.finished]
    clean = fused_llm(llama_model).generate(PROMPTS[:4], [params(i) for i in range(4)])
    assert sorted((o.request_id, o.token_ids) for o in outs) == \
        [(f"r{i}", c.token_ids) for i, c in enumerate(clean)]


def test_a_second_thread_stepping_the_same_engine_is_refused(llama_model, monkeypatch):
    """Two callers of one engine would take each other's outputs: the second is told so,
    and the first's step finishes untouched."""
    import threading

    llm = fused_llm(llama_model)
    llm.engine.add_request("r0", PROMPTS[0], params(0))
    inside, resume = threading.Event(), threading.Event()
    launch = llm.engine.runner.launch

    def held(*args, **kwargs):
        inside.set()
        resume.wait(30)
        return launch(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "launch", held)
    first = threading.Thread(target=llm.engine.step)
    first.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="one caller at a time"):
        llm.engine.step()
    resume.set()
    first.join(30)
    monkeypatch.undo()
    outs = []
    while llm.engine.has_unfinished():
        outs += [o for o in llm.engine.step() if o.finished]
    (clean,) = fused_llm(llama_model).generate([PROMPTS[0]], params(0))
    assert [o.token_ids for o in outs] == [clean.token_ids]
