#!/usr/bin/env bash
# The mixture-of-experts rows of docs/benchmarks.md: the Qwen3-30B-A3B shape (128 experts,
# top 8) with random bf16 weights built on the GPU, `roseinfer bench offline`, beside the
# dense Llama-3-8B shape, alternated, on the same GPU; each run's decode bytes floor is
# taken at the copy bandwidth measured first (bandwidth.py) and counts the experts a step
# chooses (bench/floor.py). `fp8`: the same shape with FP8 experts and linears; `mixtral`:
# the Mixtral-8x7B shape at batch 1 (93 GB of bf16 weights: an H200, or TP 2); `gpt-oss`:
# the gpt-oss-20b shape, experts in bf16.
# `tp2` (two GPUs): tensor against expert parallelism, and Mixtral at TP 2.
# `gemma`: the Gemma-3-12B shape (five 1,024-token window layers to each global one) at
# batch 1 and 64 x (512 -> 256), the Gemma-2-9B shape at batch 1; `gemma-long`: Gemma-3-12B
# at batch 1 after a 32k-token prompt, against the same shape with every layer global,
# alternated, and the KV memory each holds there (window_memory.py).
# Usage: OUT=dir bash docs/bench/family_shapes.sh [layer] [offline] [fp8] [mixtral] [gpt-oss]
#   [tp2] [gemma] [gemma-long]
source "$(dirname "$0")/bench_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H 2>/dev/null; date -u; } \
  > "$OUT/machine.txt"
python3 docs/bench/bandwidth.py | tee "$OUT/bandwidth.txt"
peak=$(grep -o "[0-9.]* TB/s" "$OUT/bandwidth.txt" | cut -d' ' -f1)
common="--dtype bfloat16 --dataset random --ignore-eos --no-enable-prefix-cache
  --max-model-len 4096 --no-progress --warmup-runs 1 --repeat-runs 2 --peak-tb-s $peak"
run() {  # name, flags
  python3 -m roseinfer.cli bench offline $common "${@:2}" --output-json "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1: $(grep -E "completion tok/s|TPOT" "$OUT/$1.log" | tail -2 | tr -s ' │' ' ')" \
    "$(grep -o "reaches .* of it" "$OUT/$1.log" | tail -1)"
}
shape() {  # batch, new tokens
  echo "--input-len 512 --num-requests $1 --max-num-seqs $1 --max-new-tokens $2"
}
for part in ${@:-layer offline}; do case $part in
layer)
  python3 docs/bench/moe_layer.py --peak-tbps "$peak" --profile 2>&1 | tee "$OUT/layer.txt"
  python3 docs/bench/moe_layer.py --peak-tbps "$peak" --fp8 --profile 2>&1 \
    | tee "$OUT/layer-fp8.txt" ;;
offline)
  for model in qwen3-30b-a3b-random llama3-8b-random; do
    name=${model%-random}
    run "$name-b1" --model $model $(shape 1 128)
    run "$name-b64" --model $model $(shape 64 256)
  done ;;
fp8)
  run qwen3-30b-a3b-fp8-b1 --model qwen3-30b-a3b-random --quantization fp8 $(shape 1 128)
  run qwen3-30b-a3b-fp8-b64 --model qwen3-30b-a3b-random --quantization fp8 $(shape 64 256) ;;
mixtral)
  run mixtral-8x7b-b1 --model mixtral-8x7b-random $(shape 1 128) ;;
gpt-oss)
  run gpt-oss-20b-b1 --model gpt-oss-20b-random $(shape 1 128)
  run gpt-oss-20b-b64 --model gpt-oss-20b-random $(shape 64 256) ;;
gemma)
  run gemma3-12b-b1 --model gemma3-12b-random $(shape 1 128)
  run gemma3-12b-b64 --model gemma3-12b-random $(shape 64 256)
  run gemma2-9b-b1 --model gemma2-9b-random $(shape 1 128) ;;
gemma-long)
  long="--input-len 32768 --num-requests 1 --max-num-seqs 1 --max-new-tokens 128
    --max-model-len 33024"
  turn=0
  for model in gemma3-12b gemma3-12b-full gemma3-12b gemma3-12b-full; do
    run "$model-32k-$((++turn))" --model $model-random $long
  done
  python3 docs/bench/window_memory.py | tee "$OUT/window_memory.txt" ;;
tp2)  # two GPUs: each expert's rows split (tensor parallel) or whole experts (expert
      # parallel), alternated; Mixtral at TP 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  for batch in "1 128" "64 256"; do
    set -- $batch
    run "qwen3-30b-a3b-tp2-b$1" --model qwen3-30b-a3b-random --tensor-parallel-size 2 $(shape $1 $2)
    run "qwen3-30b-a3b-ep2-b$1" --model qwen3-30b-a3b-random --tensor-parallel-size 2 \
      --enable-expert-parallel $(shape $1 $2)
    run "mixtral-8x7b-tp2-b$1" --model mixtral-8x7b-random --tensor-parallel-size 2 $(shape $1 $2)
  done ;;
esac; done
# One line per run (the lent machine returns only so many files), the runs packed.
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    s, floor = d["roseinfer"]["summary"], d.get("bytes_floor", {})
    print(f"{f.stem}: {s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.2f} ms, "
          f"TPOT p50 {s['tpot_ms']['p50']:.3f} ms, floor {floor.get('output_throughput', 0):.1f} "
          f"tok/s ({floor.get('fraction', 0):.1%} of it)")
PY
(cd "$OUT" && ls *.json >/dev/null 2>&1 && tar czf runs.tgz *.json *.log && rm -f *.json *.log)
