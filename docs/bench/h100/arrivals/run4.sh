#!/usr/bin/env bash
# 1) LoRA's shrink in the skinny launch at one row: the GPU tests, then lora_bench.py's
#    batch-1 rows for .base (the tree before, 2176928) and the working tree, one each.
# 2) RoPE in the KV append alone: ROSEINFER_FOLDS=0 and 1, one each.
# Usage: OUT=dir bash docs/bench/h100/arrivals/run4.sh
source docs/bench/bench_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_lora_kernels.py tests/test_lora.py \
  tests/test_rope_append.py > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt"
here=$PYTHONPATH
for tree in base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  echo "== tree $tree" | tee -a "$OUT/lora-b1.txt"
  timeout 150 python3 docs/bench/lora_bench.py --parts b1 2>&1 | grep "^{" | tee -a "$OUT/lora-b1.txt"
done
export PYTHONPATH=$here
for f in 0 1 0 1; do
  echo "== ROSEINFER_FOLDS=$f" | tee -a "$OUT/rope-append.txt"
  ROSEINFER_FOLDS=$f PEAK_TB_S=3.00 timeout 60 python3 docs/bench/decode_profile.py \
    llama3-8b-random:1 llama3-1b-random:1 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/rope-append.txt" | grep -E "^==|decode step"
done
