"""One line of a `roseinfer bench serve --output-json` file: throughput, TTFT and TPOT
p50 / p99. Usage: python3 docs/bench/serve_summary.py FILE LABEL"""
import json
import sys

s = json.load(open(sys.argv[1]))["roseinfer"]["summary"]


def d(k: str) -> str:
    return f"{s[k]['p50']:.2f} / {s[k]['p99']:.2f}"


print(f"{sys.argv[2]}: {s['output_throughput']:,.0f} tok/s, TTFT {d('ttft_ms')} ms, "
      f"TPOT {d('tpot_ms')} ms (p50 / p99)")
