#!/usr/bin/env bash
# `make gpu-check`: run python -m bench.gpu_check with a Python whose torch sees CUDA.
#
# A GPU machine's image brings the torch built for its driver (and numpy), and often no route to a
# package index: there the check runs on that `python3` as it is, from this source tree, with the
# few pure-Python needs it may lack (pydantic, zlib-ng, ...) installed, only when it lacks one, from
# the wheels that `make gpu-wheels` fetched into .whl/ on a machine that has one (carry .whl along),
# into .whl/site. Anywhere else it runs on .venv (`make setup`), where it exits 3 without CUDA after
# saying so.
#
# Usage: scripts/gpu_check.sh [bench.gpu_check options]; GPU_PYTHON picks the interpreter to try first.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${GPU_PYTHON:-python3}"
needs="import pydantic, yaml, fsspec, zlib_ng, numpy"

if "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$python" -c "$needs" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        site="$PWD/.whl/site"  # beside the wheels, in this checkout: no shared folder shadows the image
        rm -rf "$site"
        if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl; then
            echo "gpu-check: the wheels in .whl/ do not install on $python (another Python version?);" \
                 "fix: make gpu-wheels GPU_PYTHON_VERSION=<its version> where a package index is reachable" >&2
            exit 2
        fi
        export PYTHONPATH="$site:$PYTHONPATH"
    fi
    if ! missing=$("$python" -c "$needs" 2>&1); then
        echo "gpu-check: $python has a CUDA torch but lacks a package the check imports:" >&2
        echo "  ${missing##*$'\n'}" >&2
        echo "  fix: run 'make gpu-wheels' where a package index is reachable, and bring .whl/ along" >&2
        exit 2
    fi
    echo "gpu-check: $("$python" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)')"
    exec "$python" -m bench.gpu_check "$@"
fi

make -s setup
exec .venv/bin/python -m bench.gpu_check "$@"
