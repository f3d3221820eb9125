#!/usr/bin/env bash
# The device checks of dlrmctl in one call, for a short GPU slot that may end in a kill:
#
#   bash scripts/gpu_check.sh [--out DIR]      # default DIR: $OUT, else ./gpu_check_out
#
# Runs the checkout from source (PYTHONPATH=<repo>; needs torch, numpy, pyarrow, pyyaml, typer, tqdm and
# pytest; NOT torchx, tritonclient or fbgemm_gpu: without fbgemm the tables run on the `dense` kernel and
# every figure says so).  The steps, their limits and the files written (at most 8 under DIR: the summary
# gpu_check.json, the records steps.jsonl, at most 6 logs) are described in scripts/gpu_check.py.
# GPU_CHECK_LIMIT_SCALE multiplies the per-step limits (a loaded CPU machine).
#
# Scratch files go to a fresh directory under $TMPDIR (created when missing; the check stops at once,
# exit 2, when it cannot be made) and are removed at the end.
set -uo pipefail

DIR="${OUT:-$(pwd)/gpu_check_out}"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) DIR="$2"; shift 2 ;;
        --out=*) DIR="${1#--out=}"; shift ;;
        *) echo "gpu_check: unknown argument $1 (usage: gpu_check.sh [--out DIR])" >&2; exit 2 ;;
    esac
done
case "$DIR" in /*) ;; *) DIR="$(pwd)/$DIR" ;; esac
cd "$(dirname "$0")/.." || exit 2
REPO="$(pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export DLRMCTL_COLLECTIVE_TIMEOUT_S=120 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
mkdir -p "$DIR" || { echo "gpu_check: error: cannot create the output directory $DIR" >&2; exit 2; }
TMPBASE="${TMPDIR:-/tmp}"
if ! mkdir -p "$TMPBASE" 2>/dev/null; then
    echo "gpu_check: error: cannot create the scratch directory TMPDIR=$TMPBASE; set TMPDIR to a writable directory" >&2
    exit 2
fi
WORK="$(mktemp -d "$TMPBASE/gpu_check.XXXXXX")" && [ -n "$WORK" ] && [ -d "$WORK" ] || {
    echo "gpu_check: error: cannot create a scratch directory under TMPDIR=$TMPBASE" >&2; exit 2; }
export TMPDIR="$WORK"  # everything the steps write to a temp path stays under WORK
trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-$(command -v python || command -v python3)}"
if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch" >/dev/null 2>&1 && [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; fi
"$PY" "$REPO/scripts/gpu_check.py" --out "$DIR" --work "$WORK"
