#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install dlrmctl with
# the extras given as arguments (default: cpu,test).  Used by quickstart.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-cpu,test}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="${DLRMCTL_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q -e ".[${EXTRAS}]"
