#!/usr/bin/env bash
# Arrival counters (core/arrivals.py) on a GPU: the tests that run them compiled, then
# decode_profile.py's batch-1 step for the tree before (.base, the commit before) and the
# working tree, alternated. Usage: OUT=dir bash docs/bench/h100/arrivals/run1.sh
source docs/bench/bench_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py \
  tests/test_greedy_equality.py tests/test_attention_backends.py \
  -k "moe or expert or route or align or mixed_lengths or every_attention or split or tensor_cores or sinks" \
  > "$OUT/tests.txt" 2>&1
tail -4 "$OUT/tests.txt"
python3 docs/bench/bandwidth.py | tee "$OUT/bandwidth.txt"
peak=$(grep -o "[0-9.]* TB/s" "$OUT/bandwidth.txt" | cut -d' ' -f1)
here=$PYTHONPATH
for tree in base new base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  echo "== tree $tree" | tee -a "$OUT/profile.txt"
  PEAK_TB_S=$peak timeout 100 python3 docs/bench/decode_profile.py llama3-8b-random:1 \
    qwen3-30b-a3b-random:1 llama3-1b-random:1 2>&1 | grep -E "^==|decode step|us/step" \
    | head -80 | tee -a "$OUT/profile.txt" | grep -E "^==|decode step"
done
