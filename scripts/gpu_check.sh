#!/usr/bin/env bash
# `make gpu-check`: run python -m bench.gpu_check with a Python whose torch sees CUDA.
#
# A GPU machine's image brings the torch built for its driver (and numpy), and often no route to a
# package index: there the check runs on that `python3` as it is, from this source tree, with the
# few pure-Python needs it may lack (pydantic, zlib-ng, ...) installed from the wheels that
# `make gpu-wheels` fetched into .whl/ on a machine that has one (carry .whl along). Anywhere
# else it runs on .venv (`make setup`), where it exits 3 without CUDA after saying so.
#
# Usage: scripts/gpu_check.sh [bench.gpu_check options]; GPU_PYTHON picks the interpreter to try first.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${GPU_PYTHON:-python3}"
needs="import pydantic, yaml, fsspec, zlib_ng, numpy"

if "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    site="${TMPDIR:-/tmp}/undying-gpu-site"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    fi
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! missing=$("$python" -c "$needs" 2>&1); then
        echo "gpu-check: $python has a CUDA torch but lacks a package the check imports:" >&2
        echo "  ${missing##*$'\n'}" >&2
        echo "  fix: run 'make gpu-wheels' where a package index is reachable, and bring .whl/ along" >&2
        exit 2
    fi
    echo "gpu-check: $($python -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)')"
    exec "$python" -m bench.gpu_check "$@"
fi

make -s setup
exec .venv/bin/python -m bench.gpu_check "$@"
