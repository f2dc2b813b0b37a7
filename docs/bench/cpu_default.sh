#!/usr/bin/env bash
# The CPU rows of docs/benchmarks.md, each against transformers `generate` in the same
# process, pinned to two cores (the CI machine has two):
#   smollm2-b1  the default model, one chat prompt, 64 new tokens
#   gpt2-16x64  GPT-2 small (random weights), 16 requests of 1 or 4 tokens, 64 new
# Usage: OUT=dir [CPUS=0,1] [MODEL=SmolLM2-135M-Instruct] [REPEAT=3] [WEIGHTS="bfloat16 int8"] \
#   [STEP=off|auto|build] [ROWS="smollm2-b1 gpt2-16x64"] bash docs/bench/cpu_default.sh
# WEIGHTS: lower-precision linear weights (cpu_weight_dtype) to run each row with as well.
# STEP: cpu_compiled_step (default auto: a compiled batch-1 step if one was built here).
# (MODEL=smollm2-random has the same shapes, for machines without the weights package.)
source "$(dirname "$0")/bench_env.sh"
cpus=${CPUS:-0,1}
{ lscpu | grep -E "Model name|^CPU\(s\)"; lscpu | grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" \
    | sort -u | tr '\n' ' '; echo; git log -1 --format=%H 2>/dev/null; date -u; } > "$OUT/machine.txt"
common="--device cpu --dtype float32 --ignore-eos --no-enable-prefix-cache --no-progress
  --warmup-runs 1 --repeat-runs ${REPEAT:-3} --compare-hf --hf-variants dynamic
  --cpu-compiled-step ${STEP:-auto}"
rows=" ${ROWS:-smollm2-b1 gpt2-16x64} "
run() {  # row, weights' suffix, flags
  [[ $rows == *" $1 "* ]] || return 0
  local name=$1${2:+-$2}
  taskset -c "$cpus" python3 -m roseinfer.cli bench offline $common "${@:3}" \
    --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: $(grep -E "^roseinfer / transformers" "$OUT/$name.log" | tr '\n' ' ')"
}
for weights in float32 ${WEIGHTS:-}; do
  suffix=${weights/float32/}
  run smollm2-b1 "$suffix" --cpu-weight-dtype "$weights" \
    --model "${MODEL:-SmolLM2-135M-Instruct}" --num-requests 1 \
    --prompt "What is the capital of France?" --max-new-tokens 64
  run gpt2-16x64 "$suffix" --cpu-weight-dtype "$weights" \
    --model gpt2-random --num-requests 16 --prompt Hello --prompt-repeats 1,4 --max-new-tokens 64
done
