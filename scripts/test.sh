#!/usr/bin/env bash
# Install what the tests need and run the suite:  scripts/test.sh [--slow] [pytest args]
#
# Without --slow the end-to-end tests marked `slow` (several processes each importing torch, real
# signals and kills, long training runs) are left out, so the default run fits about 15 minutes on a
# loaded 2-core machine; --slow, or DLRMCTL_TEST_SLOW=1 in the environment (CI's .ci/run sets it),
# runs them too.  A `-m EXPR` among the pytest args replaces the default selection.
set -euo pipefail
cd "$(dirname "$0")/.."
SLOW="${DLRMCTL_TEST_SLOW:-0}"
if [ "${1:-}" = "--slow" ]; then
    SLOW=1
    shift
fi
bash scripts/setup_env.sh cpu,test
. "${DLRMCTL_VENV:-.venv}/bin/activate"
SELECT=()
[ "$SLOW" = 1 ] || SELECT=(-m "not slow")
exec python -m pytest -q -p no:cacheprovider ${SELECT[@]+"${SELECT[@]}"} "$@"
