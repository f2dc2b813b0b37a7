#!/usr/bin/env bash
# Mixed steps as CUDA graphs against eager mixed steps: one step alone
# (docs/bench/mixed_step.py), then the latency issue's workload through Redis
# (Llama-3.2-1B shape, prompts of 256/512/768 ids, 128 new tokens, 200
# requests every 20 ms and every 5 ms) with mixed graphs on and off.
# Usage: OUT=dir bash docs/bench/mixed_graphs.sh
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
python3 docs/bench/mixed_step.py > "$OUT/mixed_step.txt" 2>&1; grep -v Warning "$OUT/mixed_step.txt" | tail -5
for mixed in 4096 0; do
  for every in 20 5; do
    python3 -m roseinfer.cli bench serve --model llama3-1b-random --dtype bfloat16 --pretok \
      --prompt-repeats 256,512,768 --max-new-tokens 128 --num-requests 200 --ignore-eos \
      --no-enable-prefix-cache --submit-interval-ms "$every" --schedule absolute \
      --client-procs 2 --mixed-graph-max-tokens "$mixed" --no-progress \
      --output-json "$OUT/i15-mixed$mixed-$every.json" > /tmp/i15.log 2>&1 || tail -20 /tmp/i15.log
    python3 - "$OUT/i15-mixed$mixed-$every.json" "mixed graphs to $mixed tokens, every $every ms" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["roseinfer"]["summary"]
d = lambda k: f"{s[k]['p50']:.1f} / {s[k]['p99']:.1f}"
print(f"{sys.argv[2]}: {s['output_throughput']:,.0f} tok/s, TTFT {d('ttft_ms')}, TPOT {d('tpot_ms')}, "
      f"ITL {d('itl_ms')}, queue {d('queue_wait_ms')}, "
      f"step {s['engine_steps']['step_ms_p50']:.1f} / {s['engine_steps']['step_ms_p99']:.1f}")
PY
  done
done
