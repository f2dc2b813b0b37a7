#!/usr/bin/env bash
# Issue 71's Granite row: Granite-4.0-H-Small's shape (32 B, 9 B active) at 64 x (512 -> 256)
# beside a dense model of about its active size (Llama-3 8B), both FP8 weights so that
# Granite fits one 80 GB card, one after the other in one call. Wheels: .whl with
# transformers 5.24 (GraniteMoeHybrid as the checkpoints name it).
# Usage: OUT=dir bash docs/bench/h100/hybrid/granite-64.sh
source docs/bench/bench_env.sh
for model in granite-4.0-h-small-random llama3-8b-random; do
  timeout 280 python3 -m roseinfer.cli bench offline --model $model --quantization fp8 \
    --dataset random --input-len 512 --output-len 256 --num-requests 64 --max-num-seqs 64 \
    --ignore-eos --output-json "$OUT/$model.json" 2>&1 | tee "$OUT/$model.txt" | tail -8
done
