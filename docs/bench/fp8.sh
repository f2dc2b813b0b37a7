#!/usr/bin/env bash
# FP8 (W8A8, quantized at load) against bf16 on the Llama-3-8B shape, random weights built
# on the GPU, `roseinfer bench offline`, each run's bytes floor in its JSON:
#   batch 1 (512 -> 128) and 64 x (512 -> 256); and the FP8 tests on CUDA.
# Usage: OUT=dir bash docs/bench/fp8.sh [tests] [8b | 8b-b1 | 8b-b64]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
common="--model llama3-8b-random --dtype bfloat16 --dataset random --ignore-eos
  --no-enable-prefix-cache --max-model-len 4096 --no-progress --warmup-runs 1 --repeat-runs 2
  --input-len 512"
run() {  # name, flags
  python3 -m roseinfer.cli bench offline $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1: $(grep -E "completion tok/s" "$OUT/$1.log" | tail -1 | tr -s ' │' ' ')" \
    "$(grep -o "reaches .* of it" "$OUT/$1.log" | tail -1)"
}
for part in ${@:-tests 8b}; do case $part in
tests)
  python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py tests/test_skinny_linear.py \
    > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log" ;;
8b|8b-b1|8b-b64)
  for q in bf16 fp8; do
    flags=$([ $q = fp8 ] && echo "--quantization fp8")
    [ $part = 8b-b64 ] || run 8b-b1-$q $flags --num-requests 1 --max-num-seqs 1 --max-new-tokens 128
    [ $part = 8b-b1 ] || run 8b-b64-$q $flags --num-requests 64 --max-num-seqs 64 --max-new-tokens 256
  done ;;
esac; done
