"""`python3 -m tests`: the whole suite, ending on pytest's summary line.

The suite runs in as many pytest processes as there are cores (at most 4; pytest-xdist),
each on one thread: many tests mostly wait on worker processes, Redis failovers and
timeouts, and one torch thread per process keeps the cores from being oversubscribed
(docs/testing.md has the measurements). `python3 -m tests -n 0` runs it in this process.

Triton's native bindings report their module objects as leaked when the
interpreter tears down (a nanobind message printed after pytest's summary);
exiting right after pytest skips that teardown, not any test.
"""
import os
import sys

import pytest

args = sys.argv[1:]
if not any(a.startswith(("-n", "--numprocesses")) for a in args):
    args = ["-n", "auto", "--maxprocesses", "4", *args]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by each process's torch at import
# Paths given (`python3 -m tests tests/test_engine.py`) run alone; else the whole suite.
given = [a for a in args if not a.startswith("-") and os.path.exists(a.split("::")[0])]
code = pytest.main(["-q", "-p", "no:cacheprovider", *([] if given else ["tests"]), *args])
sys.stdout.flush()
sys.stderr.flush()
os._exit(int(code))
