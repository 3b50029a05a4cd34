#!/usr/bin/env bash
# The second half of the device run: the server itself on the GPU, beside scripts/gpu_check.sh's probe.
#
#   scripts/gpu_serve_check.sh [e2e] [pytest] [bench]      (no argument: all three, in that order)
#
# e2e     tests/e2e/test_up.py with AGENTSERVE_TEST_DEVICE=cuda: `agentserve up` on the GPU — four agents
#         against offline generation on the GPU, top, typed errors, an executor crash and its restart,
#         SIGTERM leaving nothing behind
# pytest  `pytest -m gpu tests` (partitions, decode graphs, memory, the CUDA oracle: ModelRunner on CUDA
#         token-exact against transformers); modules importing the test extra's openai or jsonschema are
#         left out where it is not installed (said in the log), so the stage fails only on a failing test
# bench   `agentserve bench` react, AgentServe vs fcfs, built-in `bench` model -> bench_react.json
# Everything else goes to serve_check.log in $OUT (or /tmp/agentserve-gpu-check). Each stage has its own time
# limit (SERVE_E2E_S, SERVE_PYTEST_S, SERVE_BENCH_S), so a stage that hangs costs only its own share.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/agentserve-gpu-check}
mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
LOG=$OUT_DIR/serve_check.log
stage() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
rc=0

e2e() {
  stage "tests/e2e/test_up.py on ${SERVE_DEVICE:-cuda}"
  AGENTSERVE_TEST_DEVICE=${SERVE_DEVICE:-cuda} timeout "${SERVE_E2E_S:-90}" "$PY" -m pytest -q -p no:cacheprovider \
    -rs tests/e2e/test_up.py >> "$LOG" 2>&1 || rc=1
}

gpu_tests() {
  stage "pytest -m gpu tests"
  local left_out=()
  for mod in ${SERVE_TEST_EXTRA:-openai jsonschema}; do  # the test extra, not carried to the device: the modules
    "$PY" -c "import $mod" 2> /dev/null && continue     # that import it are left out, so rc says what ran failed
    while IFS= read -r f; do left_out+=(--ignore "$f"); done < <(grep -rlE "^(import|from) $mod\b" tests)
  done
  [ ${#left_out[@]} -gt 0 ] && echo "left out, test extra not installed: ${left_out[*]}" | tee -a "$LOG"
  timeout "${SERVE_PYTEST_S:-120}" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests "${left_out[@]}" \
    >> "$LOG" 2>&1 || rc=1
}

bench() {
  stage "agentserve bench react"
  local logs=/tmp/agentserve-bench-logs extra=()
  mkdir -p "$logs"
  # the setting gpu_start_matrix.sh found to reach ready, when it ran first and the defaults did not
  if [ -s "$MATRIX_ENV" ]; then
    source "$MATRIX_ENV"
    for a in ${MATRIX_UP_ARGS:-}; do extra+=("--server-arg=$a"); done
    echo "bench with the start matrix's setting: $(tr '\n' ' ' < "$MATRIX_ENV")" | tee -a "$LOG"
  fi
  timeout "${SERVE_BENCH_S:-150}" agentserve bench --workload react --agents "${SERVE_AGENTS:-8}" \
    --policies agentserve,fcfs --warmup 5 --duration "${SERVE_DURATION:-20}" --model bench "${extra[@]}" \
    --json "$OUT_DIR/bench_react.json" --keep-logs "$logs" >> "$LOG" 2>&1 || rc=1
  for f in "$logs"/*.log; do
    [ -e "$f" ] || continue
    echo "-- $f" >> "$LOG"
    grep -E -i "error|traceback|allocator|backend|rung|graph|ready" "$f" | cut -c1-400 | head -n 40 >> "$LOG"
  done
}

for s in "${@:-e2e pytest bench}"; do
  for one in $s; do
    case $one in
      e2e) e2e ;;
      pytest) gpu_tests ;;
      bench) bench ;;
      *) echo "unknown stage $one (e2e, pytest, bench)" >&2; exit 2 ;;
    esac
  done
done
stage "done rc=$rc"
exit "$rc"
