#!/usr/bin/env bash
# The device check (issue 17): one prepared, offline run on a GPU box, within 7 minutes.
#
#   scripts/gpu_check.sh [gpu_probe.py options]
#
# Runs scripts/gpu_probe.py (sections: environment, sm_resource, sm_map, events_graph, gemm_lanes, physics,
# model, attention, memory, ring, pytest_gpu); results go to $OUT (the device tool's folder) or /tmp/agentserve-gpu-check:
# probe.jsonl (one JSON line per section; appended), summary.txt, gpu_check.log (appended), pytest_gpu.txt,
# memory_*.json, attention.jsonl.
# Nothing is fetched: the wheels the device image lacks (scripts/gpu_wheels.txt) are installed from
# .whl/ when that folder is there (docs/gpu.md says how to pip download them), into /tmp/site (gpu_env.sh).
# scripts/gpu_serve_check.sh is the second half of the device run: the server itself on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/agentserve-gpu-check}
mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
timeout "${PROBE_TIMEOUT:-420}" "$PY" scripts/gpu_probe.py --out "$OUT_DIR" --budget-s "${PROBE_BUDGET:-380}" "$@" \
  2>&1 | tee -a "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
