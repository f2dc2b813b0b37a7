"""A step that raises costs only the request that made it raise.

Whatever admission lets through (a value no check foresaw, a plugin's bug), an
exception inside a step must not end the requests that shared the step. The
engine takes back everything in flight (each running sequence returns to the
queue without blocks, its tokens in flight dropped, to be computed again from
its prompt and the tokens it already has), then runs the suspects again in
halves, each half alone, until the one that raises is alone: it ends with an
``internal`` error naming the exception, the others go on.

A half that passes has each of its sequences take one new token (or finish).
Before a lone sequence is failed, a one-token probe request tells a bad request
from a broken engine; a broken engine raises EngineBroken and fails nobody.

Recomputing keeps greedy tokens as they were, and sampled ones on CUDA (the
noise is keyed by seed and position); a seeded sample on the CPU draws from its
own generator, which the dropped step advanced. A sequence whose host work
fails (detokenizing, a logits processor's accept) is failed where it fails,
without recomputing anyone (Engine._collect).
"""
from __future__ import annotations

import logging

from roseinfer.core.processors import catch_up
from roseinfer.core.sampling import SamplingParams

log = logging.getLogger(__name__)
PROBE_RID = "roseinfer-probe"


class EngineBroken(RuntimeError):
    """A step failed and a one-token request alone fails too: the engine, not a request."""


def isolate(engine, error: Exception) -> list:
    """After ``engine``'s step raised ``error``: the outputs of finding and failing the
    request that raises, and of the others' steps on the way."""
    suspects = take_back(engine)
    log.warning("event=step_failed suspects=%d rids=%s", len(suspects),
                ",".join(s.key for s in suspects[:32]), exc_info=error)
    outputs, groups, healthy = [], [suspects], None
    while groups:
        group = [s for s in groups.pop() if not s.finished]
        if not group:
            continue
        try:
            run_alone(engine, group, outputs)
            continue
        except Exception as e:
            error = e
        if len(group) > 1:
            half = len(group) // 2
            groups += [group[half:], group[:half]]  # the first half runs first
            continue
        if healthy is None:
            healthy = works(engine)
        if not healthy:
            raise EngineBroken(f"a one-token request fails too after {error!r}") from error
        outputs += engine.fail(group[0], error)
    return outputs


def take_back(engine, seqs=None) -> list:
    """Undo what is in flight for ``seqs`` (default: every running sequence and every
    one with a token in flight): back to the queue without blocks."""
    scheduler = engine.scheduler
    engine._in_flight = None
    engine.runner.copies.clear()  # block copies for sequences that no longer hold them
    if seqs is None:
        seqs = scheduler.running + [s for s in scheduler.waiting if s.pending]
    scheduler.requeue(seqs)
    for seq in seqs:
        seq.pending, seq.sample_slot, seq.draft = 0, -1, None
        if seq.constraints:  # their states may have taken a dropped token early
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            seq.constraints = engine.processors.start(seq.params, prompt)
            seq.num_accepted = 0
            catch_up(seq)
    return seqs


def run_alone(engine, group: list, outputs: list) -> bool:
    """Step ``group`` on its own, each step collected before the next, until each of
    its sequences has one new token or has finished; outputs go to ``outputs``. On an
    exception the group is taken back and it propagates. False if it could not run:
    no blocks for it while the sequences set aside hold theirs (it runs later)."""
    marks = {seq: len(seq.token_ids) for seq in group}
    with engine.scheduler.only(group):
        try:
            while any(not s.finished and len(s.token_ids) == marks[s] for s in group):
                batch = engine.scheduler.schedule()
                if not batch.seqs:
                    return False
                outputs += engine._collect(engine._launch(batch, None))
        except Exception:
            take_back(engine, [s for s in group if not s.finished])
            raise
    return True


def works(engine) -> bool:
    """Whether a one-token greedy request runs alone (token 0 is in every vocabulary);
    True where it cannot run for want of blocks: nothing then speaks against the engine."""
    greedy_token = SamplingParams(max_tokens=1, temperature=0)
    probe = engine.intake.sequence(PROBE_RID, 0, [0], greedy_token, None, None)
    try:
        return not run_alone(engine, [probe], []) or probe.finished
    except Exception:
        log.exception("event=probe_failed")
        return False
    finally:
        engine.scheduler.finish(probe)
