"""Structured log lines: ``event=NAME key=value ...`` (logfmt), one per lifecycle event.

Operators grep and parse them (`grep event=finished`, Loki, `jq -R` after a split), so
every line carries its event name first and values never contain bare spaces.
"""
from __future__ import annotations

import logging

log = logging.getLogger("roseinfer.worker")


def event(name: str, level: int = logging.INFO, **fields) -> None:
    if log.isEnabledFor(level):
        log.log(level, "event=%s%s", name, "".join(f" {k}={_value(v)}" for k, v in fields.items()))


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    s = str(v)
    if s and not any(c in s for c in ' "=\n\t'):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
