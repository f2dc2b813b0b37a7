#!/usr/bin/env bash
# The one shape family whose weights the split of K sped alone (Qwen2.5-1.5B's down,
# 1536 x 8960): batch-1 steps of the tree before (.base) and after, alternated twice.
# Usage: OUT=dir bash docs/bench/h100/split-k/run9.sh
source docs/bench/bench_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_skinny_linear.py \
  tests/test_lora_kernels.py tests/test_fp8_linear.py > "$OUT/tests.txt" 2>&1; tail -1 "$OUT/tests.txt"
source docs/bench/profile_trees.sh
LIMIT_S=120 profile_trees "$OUT/qwen2.5-profile.txt" qwen2.5-1.5b-random:1 qwen3-30b-a3b-random:1
