# Sourced by the device-machine scripts (gpu_check.sh, gpu_serve_check.sh): the carried wheels and an
# `agentserve` command on a box with no network, without installing the repo.
#
# The wheels of .whl/ (scripts/gpu_wheels.txt; docs/gpu.md says how to fetch them) go into /tmp/site once;
# `agentserve` resolves to this checkout through a symlink on PYTHONPATH, and an `agentserve` launcher on PATH
# runs its CLI (the e2e tests and `agentserve bench` start servers by that name).
PY=${PYTHON:-python3}
AS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ls "$AS_REPO"/.whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.agentserve-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$AS_REPO"/.whl/*.whl && touch /tmp/site/.agentserve-wheels
fi
AS_SHIM=/tmp/agentserve-shim-$(id -u)
mkdir -p "$AS_SHIM/bin"
ln -sfn "$AS_REPO" "$AS_SHIM/agentserve"
printf '#!/bin/sh\nexec %s -c "import sys; from agentserve.cli.main import main; sys.argv[0] = \\"agentserve\\"; main()" "$@"\n' \
  "$(command -v "$PY")" > "$AS_SHIM/bin/agentserve"
chmod +x "$AS_SHIM/bin/agentserve"
export PYTHONPATH=$AS_SHIM${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export PATH=$AS_SHIM/bin:$PATH PYTHONUNBUFFERED=1
export MATRIX_ENV=${MATRIX_ENV:-/tmp/agentserve-start-matrix.env}  # gpu_start_matrix.sh -> gpu_serve_check.sh
