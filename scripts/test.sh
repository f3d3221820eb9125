#!/usr/bin/env bash
# Install what the tests need and run the whole suite:  scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh cpu,test
. "${DLRMCTL_VENV:-.venv}/bin/activate"
exec python -m pytest -q -p no:cacheprovider "$@"
