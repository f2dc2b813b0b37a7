"""Engine step times of the default model on the CPU, the ones a chat's TTFT is made of
beside background work: a 30-token prefill and a decode step at batch 1 and 8, and a
chat's prefill step while 7 background (priority 5) sequences decode.

    python3 docs/bench/cpu_steps_beside_background.py
"""
import statistics
import time

from roseinfer import LLM, SamplingParams


def drain(eng) -> list[float]:
    times = []
    while eng.has_unfinished():
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return times


def add(eng, rid: str, salt: int, max_tokens: int, priority: int = 0) -> None:
    eng.add_request(rid, [(salt * 7 + j) % 1000 + 1 for j in range(30)], SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority))


def main() -> None:
    eng = LLM("SmolLM2-135M-Instruct", device="cpu", max_num_seqs=8).engine
    for rounds in range(2):  # the first round warms up
        for batch in (1, 8):
            for i in range(batch):
                add(eng, f"{rounds}-{batch}-{i}", i, 40)
            t = drain(eng)
            if rounds:
                print(f"batch {batch}: prefill step {t[0] * 1e3:.1f} ms, decode step p50 "
                      f"{statistics.median(t[2:-2]) * 1e3:.1f} ms")
    for i in range(7):
        add(eng, f"bg{i}", 100 + i, 60, priority=5)
    for _ in range(5):
        eng.step()
    add(eng, "chat", 999, 4)
    start = time.perf_counter()
    eng.step()
    print(f"a chat's prefill step beside 7 background decodes: "
          f"{(time.perf_counter() - start) * 1e3:.1f} ms")
    drain(eng)


if __name__ == "__main__":
    main()
