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
prefix="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
fbdir="$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("fbgemm_gpu").origin))')"
cmake -S "$here" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "${JOBS:-2}"
echo "binary: $build/dlrm_infer"
echo "fbgemm_gpu dir: $fbdir"
