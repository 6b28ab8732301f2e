#!/usr/bin/env bash
# The test suite (`make test` runs it after scripts/bootstrap.sh): lint and the docs build, then pytest in two
# lanes side by side. The Ray lane (`-m ray`: every test that starts Ray or a job, one at a time, tests/conftest.py)
# starts first, in the background, while ruff, mypy and the docs build run; then the other tests run in the
# foreground. A job leaves a core idle for much of its time (start-up, waits, restarts), which the other lane uses:
# on 2 cores the suite takes about the Ray lane's time instead of the sum of both.
#
# The foreground lane prints as it runs; the Ray lane's output goes to build/test-logs/ray.log and is printed
# when it ends. Exit status: 0 only when lint, the docs build and both lanes passed. Extra arguments go to both
# pytest runs (e.g. `bash scripts/test.sh -x`).
set -uo pipefail
cd "$(dirname "$0")/.."

logs=build/test-logs
mkdir -p "$logs"
py=.venv/bin/python

# its own process group, so that an early exit (a lint error, Ctrl-C) ends the lane and the Ray processes it started
setsid "$py" -m pytest -m ray "$@" >"$logs/ray.log" 2>&1 &
ray_lane=$!
trap 'kill -TERM -- "-$ray_lane" 2>/dev/null' EXIT

make --no-print-directory lint docs || exit $?

"$py" -m pytest -m "not ray" "$@"
others=$?

wait "$ray_lane"
ray=$?
trap - EXIT
echo
echo "=============== Ray lane (pytest -m ray, run beside the tests above): $logs/ray.log ==============="
cat "$logs/ray.log"
echo "lanes: others exit $others, Ray exit $ray"
# pytest exits 5 when a lane selects no test (e.g. -k matching only the other lane's tests)
for rc in "$others" "$ray"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
[ "$others" -eq 0 ] || [ "$ray" -eq 0 ] || exit 5
