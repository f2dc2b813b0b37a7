"""core/step_times.py: each step charged its own time, also where the engine waits for
the previous step while the next one runs (a GPU), on a fake clock."""
from types import SimpleNamespace

from roseinfer.core import step_times
from roseinfer.core.step_times import StepTimes


def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(step_times.time, "monotonic", lambda: now[0])
    return now


def launch_at(now, t, tokens, device_event, compute_s=0.0, steps=1):
    """A launch at ``t`` of a step with ``tokens`` prompt tokens (or a window of ``steps``
    decode steps); on the CPU (no device event) the launch computes it, for
    ``compute_s``."""
    def launch(batch, previous):
        now[0] += compute_s
        return SimpleNamespace(batch=batch, done=device_event, started=0.0, ready=None)
    now[0] = t
    return StepTimes.launching(launch, SimpleNamespace(prefill_tokens=tokens, steps=steps),
                               None)


def test_an_overlapped_step_is_charged_from_the_step_before_it(monkeypatch):
    """A prefill of 800 tokens, then decodes: each launched while the one before runs.
    Step k's call waits for step k - 1, so its wall time is k - 1's; the samples pair
    each step's own tokens with its own time."""
    now, times = clock(monkeypatch), StepTimes()
    prefill = launch_at(now, 0.000, 800, device_event=object())
    decode = launch_at(now, 0.001, 0, device_event=object())
    now[0] = 0.025
    times.collected(prefill)   # the prefill ran 25 ms
    again = launch_at(now, 0.026, 0, device_event=object())
    now[0] = 0.031
    times.collected(decode)    # the decode queued behind it ran from 25 to 31 ms
    now[0] = 0.037
    times.collected(again)
    later = launch_at(now, 0.500, 64, device_event=object())  # idle until then
    window = launch_at(now, 0.501, 0, device_event=object(), steps=8)
    now[0] = 0.510
    times.collected(later)
    now[0] = 0.550
    times.collected(window)    # 8 decode steps in 40 ms
    taken = times.take()
    assert [t for t, _ in taken] == [800, 0, 0, 64, 0]
    assert [round(s, 3) for _, s in taken] == [0.025, 0.006, 0.006, 0.010, 0.005]
    assert times.take() == []


def test_a_cpu_step_is_charged_its_launch(monkeypatch):
    """No device event: the launch computed the step, and its results were ready then,
    though they are collected only after the next launch."""
    now, times = clock(monkeypatch), StepTimes()
    first = launch_at(now, 0.0, 300, device_event=None, compute_s=0.040)
    second = launch_at(now, 0.041, 0, device_event=None, compute_s=0.005)
    times.collected(first)
    times.collected(second)
    assert [(t, round(s, 3)) for t, s in times.take()] == [(300, 0.040), (0, 0.005)]
