#!/usr/bin/env bash
# The real-shape rows of docs/benchmarks.md: Llama-3-8B and Llama-3.2-1B shapes with
# random bf16 weights built on the GPU, `roseinfer bench offline`, each run's decode
# bytes floor (3.0 TB/s) and the fraction of it in its JSON; transformers `generate`
# (dynamic cache, the same random weights made on the GPU) in the same process for the
# rows of one prompt and output length (the nano-vllm shape's lengths vary per request).
# Usage: OUT=dir bash docs/bench/real_shapes.sh [8b] [1b] [nano]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
common="--dtype bfloat16 --dataset random --ignore-eos --no-enable-prefix-cache
  --max-model-len 4096 --no-progress --warmup-runs 1 --repeat-runs 2"
run() {  # name, flags
  python3 -m roseinfer.cli bench offline $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1: $(grep -E "completion tok/s" "$OUT/$1.log" | tail -1 | tr -s ' │' ' ')" \
    "$(grep -o "reaches .* of it" "$OUT/$1.log" | tail -1)"
}
shape() {  # batch, new tokens
  echo "--input-len 512 --num-requests $1 --max-num-seqs $1 --max-new-tokens $2
    --compare-hf --hf-variants dynamic"
}
nano="--input-len 562 --max-new-tokens 562 --range-ratio 0.822 --num-requests 256
  --max-num-seqs 256 --repeat-runs 1"   # prompts and outputs uniform in 100..1024
for part in ${@:-8b 1b nano}; do case $part in
8b)
  run 8b-b1 --model llama3-8b-random $(shape 1 128)
  run 8b-b64 --model llama3-8b-random $(shape 64 256)
  run 8b-b128 --model llama3-8b-random $(shape 128 256) ;;
1b)
  run 1b-b1 --model llama3-1b-random $(shape 1 256)
  run 1b-b256 --model llama3-1b-random $(shape 256 256)
  run 1b-b256-topp --model llama3-1b-random $(shape 256 256) --temperature 0.7 --top-p 0.9 ;;
nano)
  run nano-t06 --model llama3-1b-random $nano --temperature 0.6
  run nano-t06-topp --model llama3-1b-random $nano --temperature 0.6 --top-p 0.9
  run nano-greedy --model llama3-1b-random $nano ;;
esac; done
