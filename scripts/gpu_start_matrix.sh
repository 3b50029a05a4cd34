#!/usr/bin/env bash
# Which settings let `agentserve up` reach "ready" on this GPU: one fresh server per case, each started, waited
# for (warm-up of every rung and lane, decode graphs captured), then stopped.  For a start-up fault on a new
# machine: it names the setting that avoids it (partition backend, allocator, cuBLASLt, attention backend, dtype).
#
#   scripts/gpu_start_matrix.sh [MODEL]        (default: bench)
#
# Prints one line per case, "ready (<partition backend>)" or "FAILED: <the first error line>" (and the log's
# tail to serve_check.log); a rung that fails its warm-up leaves the ladder ("green-ctx (N rungs)" in the log),
# and one failure on every partitioned rung shows as ready on cuda-streams (the executor's fallback).
# Writes the first setting that reached ready on green contexts, when the baseline did not, as `export ...` lines
# to $MATRIX_ENV (gpu_env.sh; gpu_serve_check.sh's bench sources it).
# The `launch-blocking` case (CUDA_LAUNCH_BLOCKING=1) reports an asynchronous fault at the launch that made it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/agentserve-gpu-check}
mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
MODEL=${1:-bench}
WAIT_S=${MATRIX_WAIT_S:-40}
LOG=$OUT_DIR/serve_check.log
: > "$MATRIX_ENV"
found=""
try() {  # try LABEL "ENV ASSIGNMENTS" UP-ARGS...
  local label=$1 envs=$2; shift 2
  local dir; dir=$(mktemp -d /tmp/as-matrix.XXXX)
  # shellcheck disable=SC2086
  env $envs agentserve up --model "$MODEL" --run "mx$RANDOM" --endpoint "ipc://$dir/s.sock" \
    --no-restart "$@" > "$dir/out" 2> "$dir/err" &
  local pid=$! t=0 state="FAILED: no ready line in ${WAIT_S}s"
  while [ "$t" -lt "$((WAIT_S * 4))" ]; do
    if grep -q "ready on" "$dir/out"; then
      state="ready ($(grep -m1 -o -E "green-ctx|cuda-streams|cpu-cores" "$dir/out"))"; break
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      state="FAILED: $( (grep -m1 "^agentserve up:" "$dir/err" || tail -n1 "$dir/err") | cut -c1-300)"
      break
    fi
    sleep 0.25; t=$((t + 1))
  done
  kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  printf '%-28s %4ds  %s\n' "$label" "$((t / 4))" "$state" | tee -a "$LOG"
  if [ "${state%% *}" != ready ]; then tail -n 30 "$dir/err" | cut -c1-400 >> "$LOG"; fi
  if [ "$state" = "ready (green-ctx)" ] && [ -z "$found" ] && [ "$label" != launch-blocking ]; then
    found=$label  # the baseline itself: nothing to change, nothing written
    if [ "$label" != baseline ]; then
      for kv in $envs; do echo "export $kv" >> "$MATRIX_ENV"; done
      echo "export MATRIX_UP_ARGS='$*'" >> "$MATRIX_ENV"
    fi
  fi
  rm -rf "$dir"
}
echo "== $(date -u +%H:%M:%S) start matrix, model $MODEL" | tee -a "$LOG"
try baseline ""
try structured-prefill "AGENTSERVE_GREEN_PREFILL=structured"
try launch-blocking "CUDA_LAUNCH_BLOCKING=1"
try cuda-streams "" --partition cuda-streams
try shared-allocator "AGENTSERVE_CUDA_ALLOCATOR=shared"
try no-cublaslt-addmm "DISABLE_ADDMM_CUDA_LT=1"
try torch-attention-no-graphs "AGENTSERVE_ENGINE_ATTENTION_BACKEND=torch AGENTSERVE_ENGINE_CUDA_GRAPHS=off"
try float32 "" --dtype float32
found=${found:-none}  # the case below changes the model: not a setting for the bench
try tiny-bf16 "" --model tiny
echo "first setting that reached ready on green contexts: $found" | tee -a "$LOG"
