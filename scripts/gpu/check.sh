#!/usr/bin/env bash
# pagedllm's CUDA checks on a GPU machine, in one command from the repository root:
#
#   bash scripts/gpu/check.sh [all | PHASE[,PHASE...]]     (default: all)
#
# Phases, in this order:
#   tests   the `cuda`-marked tests (tests/cuda/ and every test file that marks some)
#   triton  the Triton kernel (attention, layer ops) and engine tests, compiled on the GPU
#   bench   scripts/gpu/bench_gpu.py (pagedllm vs HF generate vs the hardware floors)
#   profile scripts/gpu/profile_decode.py --profile: where a 1B batch-1 decode step's host
#           and GPU time go, with async scheduling (the default) and without (--sync)
# A rerun names only the phases still to do, e.g. `bash scripts/gpu/check.sh triton,bench`.
#
# Python packages the machine lacks travel as wheels in .whl/ (gitignored through
# .git/info/exclude; carry it) and are installed into /tmp/site first. Logs go to
# $OUT/<phase>.log (./out without OUT), the benchmark's numbers to $OUT/bench.json; each
# phase runs under its own time limit (TESTS_TIMEOUT, TRITON_TIMEOUT, BENCH_TIMEOUT
# seconds), a failing phase does not stop the next, and a summary of exit codes ends
# the output (124: the phase ran out of time).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
PHASES=${1:-all}
[ "$PHASES" = all ] && PHASES=tests,triton,bench,profile
T0=$(date +%s)

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "check.sh: wheel install failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The native CPU kernels are irrelevant on a GPU and building them costs minutes.
if grep -q '"off"' pagedllm/config.py && grep -q CPU_KERNELS_MODES pagedllm/config.py; then
  export PAGEDLLM_CPU_KERNELS=off
else
  export PAGEDLLM_CPU_KERNELS=auto
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# Stop after the first failing test (-x) unless PYTEST_STOP says otherwise (e.g. "").
PYTEST_STOP=${PYTEST_STOP--x}
# A hung test fails alone (pytest-timeout, where installed) instead of eating the phase.
PYTEST_TIMEOUT=""
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT="--timeout 300"

{
  echo "== $(date -u +%FT%TZ) phases: $PHASES (wheels installed in $(( $(date +%s) - T0 )) s)"
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
  python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ("triton", "transformers", "fastapi", "pydantic", "uvicorn", "xgrammar", "zmq",
             "msgspec", "gguf"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')} ({mod.__file__})")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: IMPORT FAILED: {type(e).__name__}: {e}")
import pagedllm.engine.arg_utils as a
fields = a.EngineArgs.field_names()
print("EngineArgs has enforce_eager:", "enforce_eager" in fields,
      "| gpu_memory_utilization:", "gpu_memory_utilization" in fields)
EOF
  echo "PAGEDLLM_CPU_KERNELS=$PAGEDLLM_CPU_KERNELS PYTHONPATH=$PYTHONPATH"
} 2>&1 | tee "$OUT/env.log"

declare -A RC SECS
ORDER=()

run_phase() {  # name timeout_s command...
  local name=$1 limit=$2
  shift 2
  ORDER+=("$name")
  local start
  start=$(date +%s)
  echo "== phase $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  RC[$name]=$?
  SECS[$name]=$(( $(date +%s) - start ))
  echo "== phase $name: exit ${RC[$name]} after ${SECS[$name]} s" | tee -a "$OUT/$name.log"
}

want() { [[ ",$PHASES," == *",$1,"* ]]; }

if want tests; then
  # Only files that mark tests `cuda`: collecting the whole suite would import modules
  # whose packages (openai, playwright, lm_eval, ...) the GPU machine does not have.
  # tests/cuda/ first (parity, the server, then CUDA graphs), then the other files.
  CUDA_FILES=()
  for f in tests/cuda/test_cuda_parity.py tests/cuda/test_cuda_server.py \
           tests/cuda/test_cuda_graphs.py $(ls tests/cuda/test_*.py 2>/dev/null) \
           $(grep -rlE 'mark\.cuda' tests --include='test_*.py' | sort); do
    [ -f "$f" ] && [[ " ${CUDA_FILES[*]} " != *" $f "* ]] && CUDA_FILES+=("$f")
  done
  run_phase tests "${TESTS_TIMEOUT:-200}" python3 -m pytest -q $PYTEST_STOP -m cuda \
    -p no:cacheprovider $PYTEST_TIMEOUT --durations 15 "${CUDA_FILES[@]}"
fi
if want triton; then
  run_phase triton "${TRITON_TIMEOUT:-120}" python3 -m pytest -q $PYTEST_STOP \
    -p no:cacheprovider $PYTEST_TIMEOUT --durations 10 \
    tests/attention/test_triton_attention.py tests/kernels/test_triton_layer_ops.py \
    tests/engine/test_triton_engine.py tests/worker/test_decode_graphs.py
fi
if want bench; then
  run_phase bench "${BENCH_TIMEOUT:-150}" python3 scripts/gpu/bench_gpu.py --out "$OUT"
fi
if want profile; then
  run_phase profile "${PROFILE_TIMEOUT:-90}" bash -c \
    "python3 scripts/gpu/profile_decode.py --profile && python3 scripts/gpu/profile_decode.py --sync"
fi

{
  echo
  echo "| phase | exit code | seconds |"
  echo "| --- | ---: | ---: |"
  for name in "${ORDER[@]}"; do
    echo "| $name | ${RC[$name]} | ${SECS[$name]} |"
  done
  echo "total $(( $(date +%s) - T0 )) s; logs and bench.json in $OUT"
} | tee "$OUT/summary.txt"
for name in "${ORDER[@]}"; do
  [ "${RC[$name]}" -eq 0 ] || exit 1
done
exit 0
