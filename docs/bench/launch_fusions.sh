#!/usr/bin/env bash
# Issue 66's launch fusions, before and after in one call on one GPU: decode_profile.py's
# batch-1 step (time, fraction of its bytes floor, kernels a step) and `roseinfer bench
# offline` at batch 1 × (512 → 128), for the tree in .base (roseinfer/ at the commit
# before: `git archive BASE roseinfer | tar -x -C .base`) and the working tree,
# alternated. Floors at the copy rate bandwidth.py measures first.
# BATCHES: the batches of the offline runs (512 -> 128 each; default 1); QUANTIZATION: a
# method (fp8, int4) for both the profile and the offline runs.
# Usage: OUT=dir [PROFILE=0] [ROUNDS=2] [BATCHES="1 16"] [QUANTIZATION=fp8] \
#   bash docs/bench/launch_fusions.sh MODEL [MODEL ...]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  date -u; } > "$OUT/machine.txt"
python3 docs/bench/bandwidth.py | tee "$OUT/bandwidth.txt"
peak=$(grep -o "[0-9.]* TB/s" "$OUT/bandwidth.txt" | cut -d' ' -f1)
# `python3 -m` and `-c` put the working directory first on sys.path: the base tree's runs
# start in .base (its roseinfer/), the scripts' by path with .base first on PYTHONPATH.
here=$PYTHONPATH
at() {  # tree: the directory its `-m` runs start in
  [ "$1" = base ] && echo "$PWD/.base" || echo "$PWD"
}
[ "${PROFILE:-1}" = 0 ] || for tree in base new base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  (cd "$(at $tree)" && python3 -c "import roseinfer; print('$tree', roseinfer.__file__)")
  PEAK_TB_S=$peak python3 docs/bench/decode_profile.py "${@/%/:1}" 2>&1 \
    | grep -E "^==|decode step|us/step" | tee -a "$OUT/profile.txt"
done
quantization=${QUANTIZATION:+--quantization $QUANTIZATION}
for round in $(seq "${ROUNDS:-2}"); do for model in "$@"; do for batch in ${BATCHES:-1}; do
for tree in base new; do
  [ $tree = base ] && export PYTHONPATH=$PWD/.base:$here || export PYTHONPATH=$here
  (cd "$(at $tree)" && python3 -m roseinfer.cli bench offline --dtype bfloat16 \
    --dataset random --ignore-eos --no-enable-prefix-cache --max-model-len 4096 \
    --no-progress --warmup-runs 1 --repeat-runs 2 --peak-tb-s "$peak" --model "$model" \
    --input-len 512 --num-requests "$batch" --max-num-seqs "$batch" --max-new-tokens 128 \
    $quantization) > /tmp/offline.log 2>&1
  cat /tmp/offline.log >> "$OUT/offline.log"  # few files: the machine returns so many
  echo "$model${QUANTIZATION:+ $QUANTIZATION} batch $batch $tree $round:" \
    "$(grep -E "TPOT" /tmp/offline.log | tail -1 | tr -s ' │' ' ')" \
    "$(grep -E "completion tok/s" /tmp/offline.log | tail -1 | tr -s ' │' ' ')" \
    "$(grep -o "reaches .* of it" /tmp/offline.log | tail -1)" | tee -a "$OUT/summary.txt"
done; done; done; done
