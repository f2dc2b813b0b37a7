#!/usr/bin/env bash
# The MoE alignment kernel before (.head = this tree) and after (align-chunk.patch applied:
# work a chunk of pairs independent of the experts), per call. Not yet run on a GPU.
# Usage: git apply docs/bench/h100/align/align-chunk.patch; OUT=dir bash docs/bench/h100/align/run1.sh
source docs/bench/bench_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py \
  -k "align or alignment or each_tile or real_shapes" > "$OUT/moe-tests.txt" 2>&1
tail -1 "$OUT/moe-tests.txt"
here=$PYTHONPATH
for tree in head new; do
  [ $tree = head ] && export PYTHONPATH=$PWD/.head:$here || export PYTHONPATH=$PWD:$here
  echo "== tree $tree" | tee -a "$OUT/align.txt"
  timeout 60 python3 -c 'import runpy, sys
sys.path.pop(0)
runpy.run_path("docs/bench/moe_align.py", run_name="__main__")' 2>&1 | tee -a "$OUT/align.txt"
done
