#!/usr/bin/env bash
# Compare AgentServe with llama.cpp's C++ `llama-server` on the same weights and the same workload.
#
#   scripts/compare_llamacpp.sh [--workload react] [--agents 4] [--duration 120] [--warmup 30] [--repeats 1]
#                               [--model bench] [--json out-llamacpp.json] [--plot out-llamacpp.png] [--build-only]
#
# 1. builds llama-server once from the llama.cpp tree vendored in the `llama-cpp-python` sdist
#    (cached under $AGENTSERVE_LLAMA_CACHE, default ~/.cache/agentserve/llama.cpp; ~6 min on 2 cores),
# 2. writes the model as GGUF with the `gguf` package (agentserve.bench.gguf_export),
# 3. runs `agentserve bench --policies agentserve,llama-server`: a fresh AgentServe server, then llama-server
#    on 127.0.0.1 with -np <agents>, the identical workload against both, one table with the ratios.
# Not part of CI (the build is too long).
set -euo pipefail

WORKLOAD=react AGENTS=4 DURATION=120 WARMUP=30 REPEATS=1 MODEL=bench JSON=out-llamacpp.json PLOT="" BUILD_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workload) WORKLOAD=$2; shift 2 ;;
    --agents) AGENTS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --json) JSON=$2; shift 2 ;;
    --plot) PLOT=$2; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

CACHE=${AGENTSERVE_LLAMA_CACHE:-$HOME/.cache/agentserve/llama.cpp}
PY=${PYTHON:-python}
JOBS=${JOBS:-$(nproc)}
BIN="$CACHE/bin/llama-server"

build_llama_server() {
  if [[ -x "$BIN" ]]; then echo "llama-server: cached at $BIN"; return; fi
  mkdir -p "$CACHE/src" "$CACHE/bin"
  local sdist
  sdist=$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
  if [[ -z "$sdist" ]]; then
    "$PY" -m pip download --no-binary :all: --no-deps llama-cpp-python -d "$CACHE/src"
    sdist=$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz | head -1)
  fi
  local tree
  tree=$(ls -d "$CACHE"/src/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
  if [[ -z "$tree" ]]; then  # an interrupted build resumes in the same tree
    rm -rf "$CACHE/src/.unpack" && mkdir "$CACHE/src/.unpack"  # unpacked aside, moved in whole
    tar xzf "$sdist" -C "$CACHE/src/.unpack"
    for d in "$CACHE"/src/.unpack/llama_cpp_python-*; do  # replaces a half tree an older run left
      rm -rf "$CACHE/src/${d##*/}" && mv "$d" "$CACHE/src/"
    done
    rmdir "$CACHE/src/.unpack"
    tree=$(ls -d "$CACHE"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)
  fi
  echo "llama-server: building from $tree with $JOBS jobs (several minutes)"
  nice -n 19 cmake -S "$tree" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  nice -n 19 cmake --build "$CACHE/build" --target llama-server -j "$JOBS"
  cp "$CACHE/build/bin/llama-server" "$BIN"
  ln -sfn "$tree" "$CACHE/tree"
  echo "llama-server: built $BIN"
}

ensure_gguf() {
  "$PY" -c "import gguf" 2>/dev/null && return
  # the gguf-py of the same llama.cpp tree matches the server's format exactly
  "$PY" -m pip install "$CACHE/tree/gguf-py"
}

build_llama_server
ensure_gguf
GGUF="$CACHE/models/$MODEL.gguf"
if [[ ! -f "$GGUF" ]]; then
  mkdir -p "$CACHE/models"
  "$PY" -m agentserve.bench.gguf_export --model "$MODEL" --out "$GGUF"
fi
echo "gguf: $GGUF"
[[ $BUILD_ONLY == 1 ]] && exit 0

args=(--workload "$WORKLOAD" --agents "$AGENTS" --duration "$DURATION" --warmup "$WARMUP" --repeats "$REPEATS"
      --model "$MODEL" --policies agentserve,llama-server --json "$JSON")
[[ -n "$PLOT" ]] && args+=(--plot "$PLOT")
AGENTSERVE_LLAMA_SERVER="$BIN" AGENTSERVE_LLAMA_GGUF="$GGUF" agentserve bench "${args[@]}"
echo "machine: $(uname -m), $(nproc) cores, $(date -u +%Y-%m-%d)"
