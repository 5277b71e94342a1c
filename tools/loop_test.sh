#!/usr/bin/env bash
# Run one pytest node id N times, each in a fresh process (as CI would), and count the failures: how a flaky test is
# shown fixed.   bash tools/loop_test.sh 50 "tests/test_distributed.py::test_process_group_made_again"
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: loop_test.sh N NODE_ID}; node=${2:?usage: loop_test.sh N NODE_ID}
PY=${PYTHON:-.venv/bin/python}
fail=0; start=$(date +%s)
for i in $(seq 1 "$n"); do
  log=$(mktemp)
  if ! "$PY" -m pytest -q -p no:cacheprovider "$node" >"$log" 2>&1; then
    fail=$((fail + 1)); echo "run $i failed:"; tail -5 "$log"
  fi
  rm -f "$log"
done
echo "$node: $fail failures in $n runs ($(( $(date +%s) - start )) s)"
[ "$fail" -eq 0 ]
