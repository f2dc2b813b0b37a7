#!/usr/bin/env bash
# Issue 71: where Granite-4.0-H-Small's prefill goes (64 x 512 prompt tokens, FP8 weights),
# beside Llama-3 8B's at the same shape, then Llama-3 8B's 64 x (512 -> 256) row that
# granite-64.sh did not reach. Wheels: .whl (transformers 5.24, redis, msgpack).
# Usage: OUT=dir bash docs/bench/h100/hybrid/granite-prefill.sh
source docs/bench/bench_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
for model in granite-4.0-h-small-random llama3-8b-random; do
  timeout 200 python3 docs/bench/prefill_profile.py --model $model --quantization fp8 \
    --prompts 64 --input-len 512 --top 40 2>&1 | tee "$OUT/prefill-$model.txt" | head -50
done
timeout 150 python3 -m roseinfer.cli bench offline --model llama3-8b-random --quantization fp8 \
  --dataset random --input-len 512 --output-len 256 --num-requests 64 --max-num-seqs 64 \
  --ignore-eos --output-json "$OUT/llama3-8b-random.json" 2>&1 | tee "$OUT/llama3-8b-random.txt" | tail -22
