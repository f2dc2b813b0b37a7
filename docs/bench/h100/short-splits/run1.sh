#!/usr/bin/env bash
# Decode attention at short contexts under a long graph bound: the merge that reads only
# the splits holding keys (working tree) against the tree before it (.head), kernel alone
# and in batch-1 steps, alternated twice. Usage: OUT=dir bash docs/bench/h100/short-splits/run1.sh
source docs/bench/bench_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py \
  > "$OUT/tests.txt" 2>&1; tail -1 "$OUT/tests.txt"
here=$PYTHONPATH
for tree in head new; do
  [ $tree = head ] && export PYTHONPATH=$PWD/.head:$here || export PYTHONPATH=$PWD:$here
  mkdir -p "$OUT/$tree"
  OUT=$OUT/$tree timeout 150 python3 -c 'import runpy, sys
sys.path.pop(0)
sys.argv = ["short_context_splits.py"] + sys.argv[1:]
runpy.run_path("docs/bench/short_context_splits.py", run_name="__main__")' 2>&1 | tee "$OUT/$tree/splits.txt"
done
export PYTHONPATH=$here
source docs/bench/profile_trees.sh
BASE=.head LIMIT_S=100 profile_trees "$OUT/profile.txt" qwen3-30b-a3b-random:1 llama3-1b-random:1
