#!/usr/bin/env bash
# The paper's evaluation on this machine, one command: agent-count sweeps of every system, then paper.md.
#
#   scripts/paper_eval.sh [--out docs/paper] [--doc docs/paper.md] [--workloads react,plan-execute]
#                         [--agents 1,2,3,4,5,6] [--policies LIST] [--warmup 20] [--duration 40] [--repeats 1]
#                         [--model bench] [--dry-run]
#
# For each workload: `agentserve bench --agents ... --json OUT/W.json --plot OUT/W.png` (a fresh server per
# system, agent count and repeat), then `agentserve bench --report OUT --report-out DOC`: the paper's claims
# beside the figures measured, every number read from OUT/*.json. Default systems: every in-engine policy,
# plus llama-server when scripts/compare_llamacpp.sh --build-only has built it. A system that fails at a
# count is recorded as failed there (bench then exits non-zero); the sweep goes on and the report says so.
# Not part of CI: with the defaults, 36 runs (42 with llama-server) of ~70 s per workload, ~1.4 h in all (docs/bench.md).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=docs/paper DOC=docs/paper.md WORKLOADS=react,plan-execute AGENTS=1,2,3,4,5,6 POLICIES=""
WARMUP=20 DURATION=40 REPEATS=1 MODEL=bench DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --doc) DOC=$2; shift 2 ;;
    --workloads) WORKLOADS=$2; shift 2 ;;
    --agents) AGENTS=$2; shift 2 ;;
    --policies) POLICIES=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

AGENTSERVE=${AGENTSERVE:-agentserve}
LLAMA=${AGENTSERVE_LLAMA_SERVER:-${AGENTSERVE_LLAMA_CACHE:-$HOME/.cache/agentserve/llama.cpp}/bin/llama-server}
if [[ -z "$POLICIES" ]]; then
  POLICIES=agentserve,no-feedback,no-partition,chunked,fcfs,llamacpp
  if [[ -x "$LLAMA" ]]; then POLICIES+=",llama-server"; else echo "llama-server not built ($LLAMA): left out"; fi
fi

IFS=, read -ra WL <<< "$WORKLOADS"
IFS=, read -ra NS <<< "$AGENTS"
IFS=, read -ra PS <<< "$POLICIES"
RUNS=$(( ${#WL[@]} * ${#NS[@]} * ${#PS[@]} * REPEATS ))
echo "$RUNS runs of ${WARMUP} + ${DURATION} s (+ a server start and drain each) over ${WORKLOADS}; systems ${POLICIES}"
echo "start $(date -u +%FT%TZ) on $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || uname -m);" \
     "load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || true)"

run() { echo "+ $*"; if [[ $DRY == 0 ]]; then "$@"; fi; }

run mkdir -p "$OUT" "$(dirname "$DOC")"
status=0
for w in "${WL[@]}"; do
  run "$AGENTSERVE" bench --workload "$w" --agents "$AGENTS" --policies "$POLICIES" --warmup "$WARMUP" \
      --duration "$DURATION" --repeats "$REPEATS" --model "$MODEL" --json "$OUT/$w.json" --plot "$OUT/$w.png" \
    || status=$?  # a system that failed somewhere: the JSON is written all the same
done
run "$AGENTSERVE" bench --report "$OUT" --report-out "$DOC"
echo "end $(date -u +%FT%TZ); bench exit status $status (non-zero: a system failed or erred somewhere, see $DOC)"
