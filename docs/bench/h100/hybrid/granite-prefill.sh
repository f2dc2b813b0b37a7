#!/usr/bin/env bash
# Issue 71: Granite-4.0-H-Small's shape (FP8 weights) with fla-core's kernels carried (the
# row of granite-64.sh ran without them, its Mamba2 prompts in plain torch): where a
# 64 x 512 prefill goes, then the 64 x (512 -> 256) row again. MODELS names others (the
# dense model of about its active size: llama3-8b-random). Wheels: .whl (transformers
# 5.24, fla-core 0.6.0, redis, msgpack).
# Usage: OUT=dir [MODELS="..."] bash docs/bench/h100/hybrid/granite-prefill.sh
source docs/bench/bench_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c "import fla, triton, torch; print('fla', fla.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" | tee -a "$OUT/card.txt"
for model in ${MODELS:-granite-4.0-h-small-random}; do
  timeout 200 python3 docs/bench/prefill_profile.py --model $model --quantization fp8 \
    --prompts 64 --input-len 512 --top 40 2>&1 | tee "$OUT/prefill-$model.txt" | head -40
  timeout 170 python3 -m roseinfer.cli bench offline --model $model --quantization fp8 \
    --dataset random --input-len 512 --output-len 256 --num-requests 64 --max-num-seqs 64 \
    --ignore-eos --output-json "$OUT/$model.json" 2>&1 | tee "$OUT/$model.txt" | tail -22
done
