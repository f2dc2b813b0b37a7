#!/usr/bin/env bash
# A fleet through one Redis: the same load on one worker, then on two (one per GPU), each
# a `roseinfer worker` process; the load from `bench serve --no-worker`, 8 client processes.
# Usage: OUT=dir bash docs/bench/fleet.sh   (wheels in .whl where pip cannot fetch; on a
# machine without GPUs: DEVICE=cpu N=16 TOKENS=8 MODELS=gpt2 for a smoke run)
source "$(dirname "$0")/bench_env.sh"
DEVICE=${DEVICE:-cuda}; N=${N:-2048}; TOKENS=${TOKENS:-256}; MODELS=${MODELS:-gpt2 llama1b}
PORT=${PORT:-$(python3 -c "from roseinfer.frontends.redis_streams.server import free_port; print(free_port())")}
URL=redis://127.0.0.1:$PORT
python3 -c "
import signal
from roseinfer.frontends.redis_streams.server import EmbeddedRedis
EmbeddedRedis(port=$PORT).start(); print('redis up', flush=True); signal.sigwait([signal.SIGTERM])" \
  > "$OUT/redis.log" 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
for _ in $(seq 100); do grep -q "redis up" "$OUT/redis.log" && break; sleep 0.2; done
grep -q "redis up" "$OUT/redis.log" || { echo "redis did not start:"; cat "$OUT/redis.log"; exit 1; }

start_worker() {  # gpu, model, dtype, prefix
  CUDA_VISIBLE_DEVICES=$1 python3 -m roseinfer.cli worker --redis-url $URL --prefix $4 \
    --model $2 --dtype $3 --device $DEVICE --max-num-seqs 256 --raw \
    > "$OUT/worker-$4-gpu$1.log" 2>&1 &
  for _ in $(seq 240); do
    grep -q "event=started" "$OUT/worker-$4-gpu$1.log" && return 0
    grep -q "Traceback\|cannot reach" "$OUT/worker-$4-gpu$1.log" && break; sleep 1
  done
  echo "worker on GPU $1 did not start"; tail -5 "$OUT/worker-$4-gpu$1.log"; return 1
}

load() {  # name, model, prefix
  python3 -m roseinfer.cli bench serve --no-worker --redis-url $URL --prefix $3 --model $2 \
    --dataset random --input-len 32 --num-requests $N --max-new-tokens $TOKENS --ignore-eos \
    --client-procs 8 --warmup-runs 1 --repeat-runs 2 --no-progress \
    --output-json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  grep -E "completion tok/s" "$OUT/$1.log" | tail -1 | sed "s/^/$1: /"
}

for m in $MODELS; do
  case $m in gpt2) model=gpt2-random; dtype=float16 ;; llama1b) model=llama3-1b-random; dtype=bfloat16 ;; esac
  [ "$DEVICE" = cpu ] && dtype=float32
  start_worker 0 $model $dtype fleet-$m || exit 1
  load $m-1worker $model fleet-$m
  start_worker 1 $model $dtype fleet-$m || exit 1
  load $m-2workers $model fleet-$m
  pkill -f "prefix fleet-$m" ; sleep 3
done
