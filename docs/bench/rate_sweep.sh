#!/usr/bin/env bash
# Latency against the arrival rate through Redis (embedded redis-server, worker thread,
# 2 client processes): Llama-3.2-1B shape, random bf16 weights, 500 requests of 512
# random ids -> 128 new tokens, greedy, Poisson arrivals at each rate.
# Usage: OUT=dir [MODEL=llama3-1b-random] bash docs/bench/rate_sweep.sh [rate ...]
#   (default rates: 10 20 40 80 160; files are named $OUT/rate-[MODEL-]RATE.*)
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
MODEL=${MODEL:-llama3-1b-random}
tag=$([ "$MODEL" = llama3-1b-random ] || echo "$MODEL-")
for rate in ${@:-10 20 40 80 160}; do
  python3 -m roseinfer.cli bench serve --model "$MODEL" --dtype bfloat16 \
    --dataset random --input-len 512 --max-new-tokens 128 --num-requests 500 --ignore-eos \
    --no-enable-prefix-cache --max-model-len 4096 --request-rate "$rate" --client-procs 2 \
    --warmup-runs 1 --repeat-runs 1 --no-progress --output-json "$OUT/rate-$tag$rate.json" \
    > /tmp/rate.log 2>&1 || tail -20 /tmp/rate.log
  python3 - "$OUT/rate-$tag$rate.json" "$rate" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["roseinfer"]["summary"]
d = lambda k: f"{s[k]['p50']:.1f} / {s[k]['p99']:.1f}"
print(f"rate {sys.argv[2]}/s: {s['output_throughput']:,.0f} tok/s, TTFT {d('ttft_ms')} ms, "
      f"TPOT {d('tpot_ms')} ms, ITL {d('itl_ms')} ms, queue wait {d('queue_wait_ms')} ms")
PY
done
