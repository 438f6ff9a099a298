#!/usr/bin/env bash
# The test suite as `make test` runs it (after set-up): tests/unit and tests/integration side by
# side, in two pytest runs. The integration tests spend much of their time waiting on the services
# they drive (a served Prefect stack, lease expiry, process start-up), so they run on
# $DELTALOOP_TEST_WORKERS pytest-xdist workers (default 2), a test file per worker at a time
# (--dist loadfile: a file's module fixtures and background runs stay in one process; each worker
# has its own Prefect home, tests/conftest.py); the unit tests are hermetic (no shared service,
# their own --basetemp) and fill what the cores have left. The integration run prints as it goes;
# the unit run's output follows it (it is also kept in $DELTALOOP_STATE/logs/unit-tests.log).
# Exits non-zero when either fails. Extra arguments go to both pytest runs (e.g. -x, -k EXPR).
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${DELTALOOP_STATE:-.state}/logs"
mkdir -p "$logs"
unit_tmp="$(mktemp -d /tmp/deltaloop-unit-tests.XXXXXX)"
unit_log="$logs/unit-tests.log"
.venv/bin/python -m pytest -q --durations=15 -p no:cacheprovider --basetemp "$unit_tmp/t" "$@" tests/unit \
  >"$unit_log" 2>&1 &
unit=$!
trap 'kill "$unit" 2>/dev/null' INT TERM
.venv/bin/python -m pytest -q --durations=25 -n "${DELTALOOP_TEST_WORKERS:-2}" --dist loadfile "$@" tests/integration
integration_rc=$?
wait "$unit"
unit_rc=$?
echo "=============================== tests/unit (ran alongside; log $unit_log) ==============================="
cat "$unit_log"
rm -rf "$unit_tmp"
echo "[tests] integration exit $integration_rc, unit exit $unit_rc"
[ "$integration_rc" = 0 ] && [ "$unit_rc" = 0 ]
