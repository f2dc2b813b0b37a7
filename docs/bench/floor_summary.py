"""One line per bench JSON: completion tok/s, the decode bytes floor, the fraction
of it, TPOT p50 against the floor's mean decode step.

    python3 docs/bench/floor_summary.py OUT/*.json
"""
import json
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    s, f = r["roseinfer"]["summary"], r.get("bytes_floor")
    line = f"{path}: {s['output_throughput']:,.1f} completion tok/s, TPOT p50 {s['tpot_ms']['p50']:.2f} ms"
    if f:
        step_ms = 1e3 * f["seconds"] / f["decode_steps"]
        line += (f"; floor {f['output_throughput']:,.1f} tok/s ({100 * f['fraction']:.1f} %),"
                 f" mean floor step {step_ms:.2f} ms")
    print(line)
