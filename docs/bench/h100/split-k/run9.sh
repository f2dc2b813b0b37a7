#!/usr/bin/env bash
# The one shape family whose weights the split of K sped alone (Qwen2.5-1.5B's down,
# 1536 x 8960): batch-1 steps of the tree before (.base) and after, alternated twice.
# Usage: OUT=dir bash docs/bench/h100/split-k/run9.sh
source docs/bench/bench_env.sh
here=$PYTHONPATH
profile='import logging, runpy, sys
sys.path.pop(0)  # not the working directory: the tree PYTHONPATH names
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.argv = ["decode_profile.py"] + sys.argv[1:]
runpy.run_path("docs/bench/decode_profile.py", run_name="__main__")'
for tree in base new base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$PWD:$here
  echo "== tree $tree" | tee -a "$OUT/qwen2.5-profile.txt"
  PEAK_TB_S=3.00 timeout 120 python3 -c "$profile" qwen2.5-1.5b-random:1 qwen3-30b-a3b-random:1 2>&1 \
    | grep -E "^==|decode step|us/step|skinny kernel up to" \
    | tee -a "$OUT/qwen2.5-profile.txt" | grep -E "^==|decode step|8960|128 x 2048"
done
