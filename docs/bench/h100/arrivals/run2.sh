#!/usr/bin/env bash
# 1) The folds with the folded row's next K block loaded a pass ahead (ROSEINFER_FOLDS=0/1,
#    one tree), per call and in the 8B and 1B batch-1 steps. 2) The MoE sum in the down
#    launch on the other MoE shapes: .base (the tree before core/arrivals.py) and the
#    working tree, alternated. Usage: OUT=dir bash docs/bench/h100/arrivals/run2.sh
source docs/bench/bench_env.sh
peak=3.00  # bandwidth.py's copy rate on this machine kind in the call before (run1)
timeout 90 python3 docs/bench/folded_linears.py --rows 1 > "$OUT/folded-linears.log" 2>&1
tail -12 "$OUT/folded-linears.log"
for f in 0 1 0 1; do
  echo "== ROSEINFER_FOLDS=$f" | tee -a "$OUT/folds-profile.txt"
  ROSEINFER_FOLDS=$f PEAK_TB_S=$peak timeout 80 python3 docs/bench/decode_profile.py \
    llama3-8b-random:1 llama3-1b-random:1 2>&1 | grep -E "^==|decode step|us/step" \
    | tee -a "$OUT/folds-profile.txt" | grep -E "^==|decode step"
done
here=$PYTHONPATH
for tree in base new base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  echo "== tree $tree" | tee -a "$OUT/moe-profile.txt"
  PEAK_TB_S=$peak timeout 75 python3 docs/bench/decode_profile.py gpt-oss-20b-random:1 \
    deepseek-v2-lite-random:1 qwen3-30b-a3b-random:2 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/moe-profile.txt" | grep -E "^==|decode step"
done
