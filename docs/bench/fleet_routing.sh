#!/usr/bin/env bash
# The fleet bench (fleet_routing.py) on a machine with several GPUs: one `roseinfer worker`
# per GPU, random weights of a real shape (MODEL, default the Llama-3.2-1B shape), routing
# on against off (and, for burst, against the prefix rule alone). Worker logs go to
# /tmp/fleet-logs.
# Usage: OUT=dir [W=4] [MODEL=llama3-8b-random] bash docs/bench/fleet_routing.sh chat burst random
#   priority
source "$(dirname "$0")/bench_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
W=${W:-4}; MODEL=${MODEL:-llama3-1b-random}
{ nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; } > "$OUT/machine.txt"
run() {  # fleet_routing.py flags
  python3 docs/bench/fleet_routing.py --model $MODEL --device cuda --dtype bfloat16 \
    --vocab 128000 --worker-flags "--max-num-seqs 64" --out "$OUT" --logs /tmp/fleet-logs "$@" \
    2>&1 | tee -a "$OUT/fleet.log"
}
for w in "$@"; do
  case $w in
    chat) run --workload chat --runs 1:off $W:off $W:prefix $W:on $W:off $W:prefix $W:on ;;
    chat2) run --workload chat --runs 2:off 2:on ;;
    burst) run --workload burst --runs 1:off 2:off 2:prefix 2:on $W:off $W:prefix $W:on \
             $W:off $W:prefix $W:on \
             --conversations $((12 * W)) --turns 4 --system-tokens 2000 --user-tokens 50-150 \
             --answer-tokens 64 ;;
    random) run --workload random --runs $W:off $W:on $W:off $W:on --requests 512 \
              --prompt-tokens 1024 --answer-tokens 64 --rate 40 ;;
    priority) run --workload priority --runs $W:on --requests 64 --rate 4 --prompt-tokens 512 \
                --answer-tokens 64 --batch 12000 --batch-tokens 256 ;;
  esac
done
