#!/usr/bin/env bash
# LoRA's shrink in the skinny launch at one row: the GPU tests, then lora_bench.py's
# batch-1 rows for .base (the tree before, 2176928) and the working tree.
# Usage: OUT=dir bash docs/bench/h100/arrivals/run5.sh
source docs/bench/bench_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_lora_kernels.py tests/test_lora.py \
  > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt"
here=$PYTHONPATH
for tree in new base; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  echo "== tree $tree" | tee -a "$OUT/lora-b1.txt"
  timeout 130 python3 docs/bench/lora_bench.py --parts b1 2>&1 | grep "^{" | tee -a "$OUT/lora-b1.txt"
done
