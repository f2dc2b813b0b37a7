"""After engine.step() raised: was it the batch, or is the engine broken?

A one-token probe request decides. If the engine serves it, the batch was at fault and its
requests go back to the queue, where the delivery count finds the poison one; if not,
the engine is broken and the worker should be restarted, counting nothing against the
requests.
"""
from __future__ import annotations

import logging

from roseinfer.core.sampling import SamplingParams

log = logging.getLogger("roseinfer.worker")
PROBE_RID = "roseinfer-probe"
MAX_DRAIN_STEPS = 100  # an emptied engine needs two or three


def drain(engine) -> bool:
    """Step until the engine holds nothing; the outputs are nobody's (all aborted)."""
    for _ in range(MAX_DRAIN_STEPS):
        if not engine.has_unfinished():
            return True
        engine.step()
    return False


def abandon(engine, rids) -> None:
    """Abort these requests and drain them out, leaving the engine empty for its next user."""
    try:
        for rid in rids:
            engine.abort(rid)
        drain(engine)
    except Exception:
        log.exception("event=drain_failed")


def works_after_failure(engine, rids) -> bool:
    """Abort the failed batch, then serve a probe: True if the engine still works."""
    try:
        for rid in rids:
            engine.abort(rid)
        drain(engine)
        # Token 0 exists in every vocabulary; one token takes a prefill and a sample.
        engine.add_request(PROBE_RID, [0], SamplingParams(max_tokens=1, temperature=0))
        return drain(engine)
    except Exception:
        log.exception("event=probe_failed")
        return False
