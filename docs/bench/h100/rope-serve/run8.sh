#!/usr/bin/env bash
# The skinny linears' split of K: the GPU tests, the kernel at each split on decode
# shapes, then batch-1 steps of the tree before (.base) and after, alternated twice, with
# the splits chosen at load logged. Usage: OUT=dir bash docs/bench/h100/rope-serve/run8.sh
source docs/bench/bench_env.sh
python3 docs/bench/bandwidth.py 2>&1 | tail -1 | tee "$OUT/bandwidth.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_skinny_linear.py \
  tests/test_lora_kernels.py tests/test_dependent_launch.py > "$OUT/tests-split.txt" 2>&1
tail -1 "$OUT/tests-split.txt"
timeout 150 python3 docs/bench/skinny_linears.py splits > "$OUT/splits.txt" 2>&1
grep -E "rows  1" "$OUT/splits.txt" | awk '{print $1, $7, $8, $10}' | paste -sd' ' | fold -w 400
source docs/bench/profile_trees.sh
profile_trees "$OUT/split-profile.txt" llama3-1b-random:1 llama3-8b-random:1 qwen3-30b-a3b-random:1
grep "skinny kernel up to" "$OUT/split-profile.txt" | sort | uniq -c | grep split | head -30
