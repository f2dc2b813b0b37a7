#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md "Speculative decoding" (docs/bench/speculative.py):
#   tests  tests/test_speculative.py on CUDA (verify steps in CUDA graphs)
#   8b     Llama-3-8B shape, random bf16 weights, batch 1: a verify step of k+1 = 5
#          positions against a plain step (proposer "always", no pauses), and one round
#          of the 1B shape drafting for it
#   smol   the default model's real weights (GGUF at $SMOL), batch 1 and 64, ngram;
#          batch 1 with the default k (8 on CUDA) and k = 4, and in float32 (greedy
#          outputs equal off and on)
# Usage: OUT=dir [SMOL=path.gguf] bash docs/bench/speculative.sh [tests] [8b] [smol]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
bench() {  # name, flags
  python3 docs/bench/speculative.py --output-json "$OUT/$1.json" "${@:2}" > "$OUT/$1.log" 2>&1
  echo "$1:"; grep -E "tok/s|running means" "$OUT/$1.log"
}
random8b="--model llama3-8b-random --dtype bfloat16 --workloads always --batch 1 --num-prompts 2
  --max-tokens 128 --repeat-runs 2 --ignore-eos --no-pause --num-speculative-tokens 4"
for part in ${@:-tests 8b smol}; do case $part in
tests)
  python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py tests/test_mixed_graphs.py \
    > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log" ;;
8b)
  bench 8b-verify $random8b --proposer always
  bench 8b-draft-1b $random8b --proposer draft --draft-model llama3-1b-random ;;
smol)
  bench smol-b1 --model "${SMOL:-SmolLM2-135M-Instruct}" --batch 1 --num-prompts 8
  bench smol-b1-k4 --model "${SMOL:-SmolLM2-135M-Instruct}" --batch 1 --num-prompts 8 \
    --num-speculative-tokens 4
  bench smol-b1-fp32 --model "${SMOL:-SmolLM2-135M-Instruct}" --batch 1 --num-prompts 8 \
    --dtype float32 --repeat-runs 1
  bench smol-b64 --model "${SMOL:-SmolLM2-135M-Instruct}" --batch 64 --num-prompts 64 \
    --workloads repeat,free --repeat-runs 2 ;;
esac; done
