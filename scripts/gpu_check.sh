#!/usr/bin/env bash
# GPU check for issue 5, one prepared run on a machine with an NVIDIA GPU (< 5 minutes):
#   1. environment: nvidia-smi, torch with CUDA, cuda-bindings (installed if pip can reach an index)
#   2. `agentserve doctor --json`: backend chosen and why, ladder (rung → decode/prefill SMs)
#   3. per rung: decode step time alone vs with a concurrent 4k-token prefill on the other lane (JSON)
# Everything goes to stdout and, when $OUT is set, to $OUT/gpu_check.{txt,json}.
# Works offline: without pip it maps the repo folders into the `agentserve` namespace by symlinks.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-/tmp/agentserve-gpu-check}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.txt") 2>&1
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-200}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi: not available"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "torch with CUDA not importable by $PY; trying pip install torch"
  "$PY" -m pip install -q torch 2>&1 | tail -2 || true
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
"$PY" -c 'import cuda.bindings.driver' 2>/dev/null || "$PY" -m pip install -q 'cuda-python>=12.4' 2>&1 | tail -2 || true
for dep in msgspec click safetensors tokenizers numpy; do
  "$PY" -c "import $dep" 2>/dev/null || "$PY" -m pip install -q "$dep" 2>&1 | tail -1 || echo "missing: $dep"
done

# Make `import agentserve.*` work: an installed package, else an editable install, else symlinks.
if ! "$PY" -c 'import agentserve.executor.partition' 2>/dev/null; then
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>/dev/null; then
    SHIM=$(mktemp -d)/shim
    mkdir -p "$SHIM/agentserve"
    for d in orchestrator executor shm cli client bench configs; do ln -s "$REPO/$d" "$SHIM/agentserve/$d"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "agentserve mapped by symlinks at $SHIM"
  fi
fi

echo "== agentserve doctor --json"
if command -v agentserve >/dev/null && agentserve --help >/dev/null 2>&1; then
  timeout 120 agentserve doctor --json | tee "$OUT_DIR/doctor.json"
else  # the same command without the console script (symlink shim)
  timeout 120 "$PY" -c 'from agentserve.cli.doctor import doctor; doctor()' --json | tee "$OUT_DIR/doctor.json"
fi

echo "== lanes: per rung, decode alone vs with a concurrent 4k-token prefill on the other lane"
# bench model (8 layers, hidden 512) in bf16: decode batch of 32 at 512 cached tokens; the 4096-token
# prompt is prefilled in one chunk, 20 times back to back, so the prefill lane stays busy.
timeout "$STEP_TIMEOUT" "$PY" scripts/lane_check.py --model bench --device cuda --dtype bfloat16 \
  --batch 32 --context 512 --prefill-tokens 4096 --chunk 4096 --prefill-repeat 20 --steps 50 --json \
  | tee "$OUT_DIR/gpu_check.json"
status=${PIPESTATUS[0]}
echo "== done (lane_check exit $status)"
exit "$status"
