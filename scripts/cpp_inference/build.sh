#!/usr/bin/env bash
# Build dlrm_infer against the libtorch inside the active Python's torch wheel.
#   scripts/cpp_inference/build.sh [BUILD_DIR]     (default: scripts/cpp_inference/build)
# Prints the binary path and the fbgemm_gpu directory to pass as its 4th argument (TorchScript
# models only; an AOTInductor package of `dlrmctl export --aot` needs none):
#   dlrm_infer MODEL_DIR INPUT.bin OUTPUT.bin [FBGEMM_GPU_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/build}"
py="${PYTHON:-python}"
repo="$(cd "$here/../.." && pwd)"
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    # not the project's Python (no venv active): the project's venv when there is one
    venv="${DLRMCTL_VENV:-$repo/.venv}"
    if [ -z "${PYTHON:-}" ] && [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
        py="$venv/bin/python"
    else
        echo "error: $py has no torch: activate the project's venv (. .venv/bin/activate, made by scripts/setup_env.sh) or set PYTHON to a Python with dlrmctl's torch" >&2
        exit 2
    fi
fi
prefix="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
fbdir="$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("fbgemm_gpu").origin))')"
cmake -S "$here" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "${JOBS:-2}"
echo "binary: $build/dlrm_infer"
echo "fbgemm_gpu dir: $fbdir"
