#!/usr/bin/env bash
# RoPE in the KV append alone (the linears' folds removed): ROSEINFER_FOLDS=0 and 1,
# alternated. Usage: OUT=dir bash docs/bench/h100/arrivals/run3.sh
source docs/bench/bench_env.sh
for f in 0 1 0 1 0 1; do
  echo "== ROSEINFER_FOLDS=$f" | tee -a "$OUT/rope-append.txt"
  ROSEINFER_FOLDS=$f PEAK_TB_S=3.00 timeout 80 python3 docs/bench/decode_profile.py \
    llama3-8b-random:1 llama3-1b-random:1 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/rope-append.txt" | grep -E "^==|decode step"
done
