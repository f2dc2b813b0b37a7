#!/usr/bin/env bash
# decode_profile.py over the tree before (.base) and the working tree, alternated twice,
# with the loader's log (the skinny linears' choices) kept. Sourced by run scripts after
# bench_env.sh: [BASE=dir] profile_trees LOG MODEL:BATCH... (the tree before: BASE, or .base)
profile_trees() {
  local log=$1 here=$PYTHONPATH tree
  local profile='import logging, runpy, sys
sys.path.pop(0)  # not the working directory: the tree PYTHONPATH names
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.argv = ["decode_profile.py"] + sys.argv[1:]
runpy.run_path("docs/bench/decode_profile.py", run_name="__main__")'
  for tree in base new base new; do
    [ $tree = base ] && export PYTHONPATH=$PWD/${BASE:-.base}:$here || export PYTHONPATH=$PWD:$here
    echo "== tree $tree" | tee -a "$log"
    PEAK_TB_S=${PEAK_TB_S:-3.00} timeout "${LIMIT_S:-130}" python3 -c "$profile" "${@:2}" 2>&1 \
      | grep -E "^==|decode step|us/step|skinny kernel up to" | tee -a "$log" \
      | grep -E "^==|decode step|K split [24]"
  done
  export PYTHONPATH=$here
}
