#!/usr/bin/env bash
# RoPE in the KV append (now the default) on the other families' batch-1 steps:
# ROSEINFER_ROPE_IN_APPEND=0 and 1 alternated twice, Gemma-3-12B, Qwen3-30B-A3B (q/k norms
# in the same launch), gpt-oss-20b. The GPU tests of the model families first.
# Usage: OUT=dir bash docs/bench/h100/rope-serve/run7.sh
source docs/bench/bench_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_dependent_launch.py \
  tests/test_model_families.py > "$OUT/tests-families.txt" 2>&1; tail -1 "$OUT/tests-families.txt"
for f in 0 1 0 1; do
  echo "== ROSEINFER_ROPE_IN_APPEND=$f" | tee -a "$OUT/families-rope.txt"
  ROSEINFER_ROPE_IN_APPEND=$f PEAK_TB_S=3.00 timeout 110 python3 docs/bench/decode_profile.py \
    gemma3-12b-random:1 qwen3-30b-a3b-random:1 gpt-oss-20b-random:1 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/families-rope.txt" | grep -E "^==|decode step"
done
