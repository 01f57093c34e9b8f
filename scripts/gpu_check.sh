#!/usr/bin/env bash
# `make gpu-check`: run python -m bench.gpu_check with a Python whose torch sees CUDA.
#
# A GPU machine's image brings the torch built for its driver (and numpy), and often no route to a
# package index: there the check runs on that `python3` as it is, from this source tree, with the
# few pure-Python needs it may lack (pydantic, yaml, fsspec) unpacked, only when it lacks one, from
# the wheels that `make gpu-wheels` fetched into .whl/cpXY/ for its Python version on a machine that
# has an index (carry .whl along), into .whl/site: unpacked with Python's zipfile, so a Python
# without pip takes them too. On a machine with an NVIDIA driver (nvidia-smi) whose python3 cannot
# use CUDA, it stops with that Python's own error (no package index to fall back on). Anywhere else
# it runs on .venv (`make setup`), where it exits 3 without CUDA after saying so.
#
# Usage: scripts/gpu_check.sh [bench.gpu_check options]; GPU_PYTHON picks the interpreter to try first.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${GPU_PYTHON:-python3}"
needs="import pydantic, yaml, fsspec, numpy; assert int(pydantic.VERSION.split('.')[0]) >= 2, pydantic.VERSION"

if probe=$("$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch.cuda.is_available() is False")' 2>&1); then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if ! "$python" -c "$needs" 2>/dev/null && compgen -G ".whl/$tag/*.whl" >/dev/null; then
        site="$PWD/.whl/site"  # beside the wheels, in this checkout: no shared folder shadows the image
        rm -rf "$site"
        "$python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$site" .whl/"$tag"/*.whl
        export PYTHONPATH="$site:$PYTHONPATH"
    fi
    if ! missing=$("$python" -c "$needs" 2>&1); then
        echo "gpu-check: $python has a CUDA torch but lacks a package the check imports:" >&2
        echo "  ${missing##*$'\n'}" >&2
        echo "  fix: run 'make gpu-wheels' where a package index is reachable (it fetches $tag's among" \
             "others), and bring .whl/ along" >&2
        exit 2
    fi
    echo "gpu-check: $("$python" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)')"
    exec "$python" -m bench.gpu_check "$@"
fi

if command -v nvidia-smi >/dev/null 2>&1 && [ -z "${GPU_CHECK_ON_VENV:-}" ]; then
    echo "gpu-check: this machine has an NVIDIA driver, but $python cannot use CUDA:" >&2
    echo "  ${probe##*$'\n'}" >&2
    echo "  fix: GPU_PYTHON=<a python with a CUDA torch>, or GPU_CHECK_ON_VENV=1 to install .venv (needs an index)" >&2
    exit 2
fi
make -s setup
exec .venv/bin/python -m bench.gpu_check "$@"
