#!/usr/bin/env bash
# llama.cpp beside roseinfer on the CPU, on the default model's own GGUF file.
#
# Builds llama-bench from the vendor/llama.cpp of the registry's llama-cpp-python sdist
# (once, into $BUILD), runs it on the file (decode tg64, prompt pp32 and pp512, and
# 32 + 64 together) and llama-batched-bench (16 sequences of 32 + 64 tokens), then
# roseinfer's batch-1 decode of the same model through docs/bench/cpu_default.py (float32
# and the file's own blocks, each with its compiled step built first) and its 16-request
# row through `roseinfer bench offline`. Both with two threads.
# FLOATS=1: also the same weights as F32 and BF16 files (llama.cpp's convert_hf_to_gguf.py
# over roseinfer's de-quantized checkpoint), beside roseinfer's float32 and bfloat16 weights.
# Usage: [OUT=dir] [BUILD=/tmp/llamacpp] [THREADS=2] [FLOATS=1] bash docs/bench/llamacpp.sh
set -euo pipefail
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
BUILD=${BUILD:-/tmp/llamacpp}
THREADS=${THREADS:-2}
VERSION=0.3.36
src="$BUILD/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -x "$src/build/bin/llama-batched-bench" ]; then
  mkdir -p "$BUILD"
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD"
  tar -xzf "$BUILD/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD"
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF > "$OUT/llamacpp-cmake.log"
  cmake --build "$src/build" --target llama-bench llama-batched-bench -j "$(nproc)" \
    > "$OUT/llamacpp-build.log"
fi
gguf=$(python3 -c "from roseinfer.models.loader import ALIASES; print(ALIASES['smollm2']())")
{ lscpu | grep -E "Model name|Flags" | cut -c1-200; date -u; git rev-parse --short HEAD; } \
  > "$OUT/machine.txt"
"$src/build/bin/llama-bench" -m "$gguf" -t "$THREADS" -p 0 -n 64 -r 3 | tee "$OUT/llama-bench.md"
# On a 2-core Intel VM with AMX (2026-11-29) the native build's AMX prompt kernel died of
# SIGILL (tileloadd in an OpenMP thread) while its decode ran: the prompt rows are then
# re-run by a build without AMX ($src/build-noamx), and say so.
noamx() {  # builds target $1 without AMX (configured once) into $src/build-noamx
  [ -f "$src/build-noamx/build.ninja" ] || cmake -S "$src" -B "$src/build-noamx" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF > /dev/null
  cmake --build "$src/build-noamx" --target "$1" -j "$(nproc)" > /dev/null
}
if ! "$src/build/bin/llama-bench" -m "$gguf" -t "$THREADS" -p 32,512 -n 0 -pg 32,64 -r 3 \
    >> "$OUT/llama-bench.md"; then
  noamx llama-bench
  echo "prompt rows: the native build failed; a build without AMX:" >> "$OUT/llama-bench.md"
  "$src/build-noamx/bin/llama-bench" -m "$gguf" -t "$THREADS" -p 32,512 -n 64 -pg 32,64 -r 3 \
    | tee -a "$OUT/llama-bench.md"
fi
python3 docs/bench/cpu_default.py --prompts 4 --compiled-step build \
  --only "float32,gguf blocks" | tee "$OUT/roseinfer.txt"
batched() { "$1/bin/llama-batched-bench" -m "$gguf" -t "$THREADS" -c 2048 -npp 32 -ntg 64 -npl 16; }
# its prompts take the same AMX kernel: where that dies, the build without AMX
if ! batched "$src/build" > "$OUT/llama-batched-bench.md"; then
  noamx llama-batched-bench
  echo "the native build failed; a build without AMX:" > "$OUT/llama-batched-bench.md"
  batched "$src/build-noamx" >> "$OUT/llama-batched-bench.md"
fi
cat "$OUT/llama-batched-bench.md"
python3 -m roseinfer.cli bench offline --model smollm2 --device cpu --dataset random \
  --ignore-eos --no-enable-prefix-cache --no-progress --warmup-runs 1 --repeat-runs 2 \
  --input-len 32 --num-requests 16 --max-num-seqs 16 --max-new-tokens 64 \
  --cpu-weight-dtype gguf | tee "$OUT/roseinfer-16.txt"
if [ "${FLOATS:-0}" = 1 ]; then
  python3 -m pip install -q sentencepiece  # convert_hf_to_gguf.py imports it
  hf="$BUILD/smollm2-hf"
  rm -rf "$hf" && cp -r "$(python3 -c "from roseinfer.models.loader import _converted_gguf
print(_converted_gguf('$gguf'))")" "$hf"
  python3 - "$hf/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.pop("quantization_config", None)  # the converter reads the float weights as they are
c["architectures"] = ["LlamaForCausalLM"]
json.dump(c, open(sys.argv[1], "w"))
PY
  for t in f32 bf16; do
    python3 "$src/convert_hf_to_gguf.py" "$hf" --outtype $t --outfile "$BUILD/smollm2-$t.gguf" \
      > "$OUT/convert-$t.log" 2>&1
    "$src/build/bin/llama-bench" -m "$BUILD/smollm2-$t.gguf" -t "$THREADS" -p 512 -n 64 -r 3 \
      | tee "$OUT/llama-bench-$t.md"
  done
  python3 docs/bench/cpu_default.py --prompts 4 --compiled-step build --only float32 \
    | tee "$OUT/roseinfer-floats.txt"
  # bfloat16 weights have no compiled step (core/cpu_step.py): eager
  python3 docs/bench/cpu_default.py --prompts 4 --compiled-step off \
    --only "bfloat16 weights" | tee -a "$OUT/roseinfer-floats.txt"
fi
