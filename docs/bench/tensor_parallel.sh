#!/usr/bin/env bash
# Tensor parallelism on the GPUs of one host: the copy bandwidth that the bytes floor is
# taken at, the Llama-3-8B shape at TP 1 and 2 (batch 1; 64 x 512 -> 256), the 70B shape
# at TP N (batch 1, decode profile with the all-reduces' share, batch 64, and through
# Redis at 10 requests/s). Random bf16 weights built on the GPUs.
# Usage: OUT=dir [LIMIT_S=400] [TP70=2] bash docs/bench/tensor_parallel.sh [tests]
#        [allreduce] [8b | 8b-b1 8b-b64] [8b-serve] [70b | 70b-b1 70b-more] [mixtral]
# (the TP 2 rows of the 8B shape run twice: with the one-shot all-reduce, and with
# ROSEINFER_ONE_SHOT=0, every all-reduce through NCCL)
# (LIMIT_S: the seconds each command, or each test, may take before it is stopped with its
# stacks printed)
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m; lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null
  date -u; } > "$OUT/machine.txt" 2>&1
# Read + write bytes of a 4 GiB device-to-device copy per second: what one GPU moves.
PEAK=$(python3 - <<'EOF'
import torch
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    y.copy_(x)
end.record()
torch.cuda.synchronize()
print(f"{2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e12:.2f}")
EOF
)
echo "copy bandwidth: $PEAK TB/s" | tee -a "$OUT/machine.txt"
common="--dtype bfloat16 --dataset random --ignore-eos --no-enable-prefix-cache
  --max-model-len 4096 --no-progress --warmup-runs 1 --repeat-runs 2 --peak-tb-s $PEAK"
# A run that overstays its limit (a collective that never completes) is stopped with SIGABRT,
# ranks first: with PYTHONFAULTHANDLER each process prints its Python stacks into the log.
export PYTHONFAULTHANDLER=1
limit=${LIMIT_S:-400}
guarded() {  # seconds, log, command...
  "${@:3}" > "$2" 2>&1 & local pid=$!
  for _ in $(seq "$1"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
  if kill -0 $pid 2>/dev/null; then
    echo "HUNG: stopped after $1 s" | tee -a "$2"
    pkill -ABRT -f roseinfer.core.tp_workers; sleep 2; kill -ABRT $pid; sleep 2
    pkill -KILL -f roseinfer.core.tp_workers; kill -KILL $pid 2>/dev/null
  fi
  wait $pid
}
run() {  # name, flags
  guarded $limit "$OUT/$1.log" python3 -m roseinfer.cli bench offline $common "${@:2}" \
    --output-json "$OUT/$1.json"
  echo "$1: $(grep -E '│ completion tok/s|│ TPOT' "$OUT/$1.log" | tr -s ' │' ' ' | tr '\n' ';')" \
    "$(grep -o "reaches .* of it" "$OUT/$1.log" | tail -1)"
}
shape() { echo "--input-len 512 --num-requests $1 --max-num-seqs $1 --max-new-tokens $2"; }
n=${TP70:-2}  # the 70B shape's ranks
for part in ${@:-tests 8b 70b}; do case $part in
tests)
  # -v names each test as it starts; pytest-timeout prints the stacks of a case that runs
  # past LIMIT_S and goes on with the next. Each CUDA case takes about 36 s on two H100s
  # (graph capture and kernel timing in two processes), the file about ten minutes.
  guarded $((limit * 8)) "$OUT/tests.txt" python3 -m pytest -v -p no:cacheprovider \
    --timeout "$limit" tests/test_tensor_parallel.py
  grep -E "PASSED|FAILED|ERROR|HUNG|Timeout" "$OUT/tests.txt" | tail -25; tail -1 "$OUT/tests.txt" ;;
8b|8b-b1)
  run 8b-tp1-b1 --model llama3-8b-random --tensor-parallel-size 1 $(shape 1 128)
  run 8b-tp2-b1 --model llama3-8b-random --tensor-parallel-size 2 $(shape 1 128)
  ROSEINFER_ONE_SHOT=0 run 8b-tp2-nccl-b1 --model llama3-8b-random --tensor-parallel-size 2 \
    $(shape 1 128)
  PEAK_TB_S=$PEAK guarded $limit "$OUT/8b-tp2-b1-profile.txt" \
    python3 docs/bench/decode_profile.py llama3-8b-random:1:512:2
  echo "profile: $(grep -E "decode step|all-reduce" "$OUT/8b-tp2-b1-profile.txt" | tr '\n' ';')"
  [ $part = 8b ] || continue ;&
8b-b64)
  run 8b-tp1-b64 --model llama3-8b-random --tensor-parallel-size 1 $(shape 64 256)
  run 8b-tp2-b64 --model llama3-8b-random --tensor-parallel-size 2 $(shape 64 256)
  ROSEINFER_ONE_SHOT=0 run 8b-tp2-nccl-b64 --model llama3-8b-random --tensor-parallel-size 2 \
    $(shape 64 256) ;;
mixtral)
  run mixtral-tp2-b1 --model mixtral-8x7b-random --tensor-parallel-size 2 $(shape 1 128)
  run mixtral-tp2-b64 --model mixtral-8x7b-random --tensor-parallel-size 2 $(shape 64 256) \
    --repeat-runs 1 ;;
allreduce)
  guarded $limit "$OUT/all_reduce.txt" python3 docs/bench/all_reduce.py --json "$OUT/all_reduce.json"
  cat "$OUT/all_reduce.txt" ;;
8b-serve)
  guarded $limit "$OUT/8b-tp2-serve.log" python3 -m roseinfer.cli bench serve \
    --model llama3-8b-random --tensor-parallel-size 2 --dtype bfloat16 --dataset random \
    --input-len 512 --num-requests 100 --request-rate 10 --max-num-seqs 64 \
    --output-len 128 --ignore-eos --no-progress --warmup-runs 0 --repeat-runs 1 \
    --output-json "$OUT/8b-tp2-serve.json"
  echo "8b serve: $(grep -E '│ completion tok/s|│ TTFT|│ TPOT' "$OUT/8b-tp2-serve.log" | tr -s ' │' ' ' | tr '\n' ';')" ;;
70b|70b-b1)
  run 70b-tp$n-b1 --model llama3-70b-random --tensor-parallel-size $n $(shape 1 64) \
    --repeat-runs 1
  [ $part = 70b ] || continue ;&
70b-more)
  PEAK_TB_S=$PEAK guarded $limit "$OUT/70b-tp$n-profile.txt" \
    python3 docs/bench/decode_profile.py llama3-70b-random:1:512:$n
  grep -E "decode step|all-reduce" "$OUT/70b-tp$n-profile.txt"
  run 70b-tp$n-b64 --model llama3-70b-random --tensor-parallel-size $n $(shape 64 128) \
    --repeat-runs 1
  guarded $limit "$OUT/70b-tp$n-serve.log" python3 -m roseinfer.cli bench serve \
    --model llama3-70b-random --tensor-parallel-size $n --dtype bfloat16 --dataset random \
    --input-len 512 --num-requests 100 --request-rate 10 --max-num-seqs 64 \
    --output-len 128 --ignore-eos --no-progress --warmup-runs 0 --repeat-runs 1 \
    --output-json "$OUT/70b-tp$n-serve.json"
  echo "70b serve: $(grep -E '│ completion tok/s|│ TTFT|│ TPOT' "$OUT/70b-tp$n-serve.log" | tr -s ' │' ' ' | tr '\n' ';')" ;;
esac; done
