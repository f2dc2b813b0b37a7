#!/usr/bin/env bash
# The one shape family whose weights the split of K sped alone (Qwen2.5-1.5B's down,
# 1536 x 8960): batch-1 steps of the tree before (.base) and after, alternated twice.
# Usage: OUT=dir bash docs/bench/h100/split-k/run9.sh
source docs/bench/bench_env.sh
source docs/bench/profile_trees.sh
LIMIT_S=120 profile_trees "$OUT/qwen2.5-profile.txt" qwen2.5-1.5b-random:1 qwen3-30b-a3b-random:1
