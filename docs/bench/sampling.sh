#!/usr/bin/env bash
# Sampled against greedy decoding, same process, same GPU: GPT-2 W2 (issue 5's
# workload) and the Llama-3.2-1B shape at 256 x (512 random ids -> 256 new).
# Sampled: temperature 0.7, top_p 0.9 (--sampling T,P to change it).
# Usage: OUT=dir bash docs/bench/sampling.sh [gpt2] [llama1b]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
common="--ignore-eos --no-enable-prefix-cache --no-progress --warmup-runs 1 --repeat-runs 2"
sampled="--temperature 0.7 --top-p 0.9"
run() {  # name, flags
  python3 -m roseinfer.cli bench offline $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  grep -E "completion tok/s" "$OUT/$1.log" | tail -2 | sed "s/^/$1: /"
}
for part in ${@:-gpt2 llama1b}; do case $part in
gpt2)
  w2="--model gpt2-random --dtype float16 --pretok --num-requests 128 --prompt Hello
    --prompt-repeats 1,4 --max-new-tokens 128 --max-num-seqs 128"
  run w2-greedy $w2
  run w2-sampled $w2 $sampled ;;
llama1b)
  l1="--model llama3-1b-random --dtype bfloat16 --dataset random --input-len 512
    --num-requests 256 --max-new-tokens 256 --max-num-seqs 256"
  run llama1b-greedy $l1
  run llama1b-sampled $l1 $sampled ;;
esac; done
