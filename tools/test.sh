#!/usr/bin/env bash
# clfast's test command: installs what the tests need into .venv, checks that notebooks, library and README are in
# sync (nbdev_export / nbdev_clean / tools/readme.py change nothing), builds the C++ kernels for every level this CPU
# runs, runs the smoke run at the lowest torch settings.ini admits (tools/smoke_torch.sh; CLFAST_SMOKE=0 skips it) and
# the numerics tests at each instruction-set level below this CPU's (tools/isa_matrix.py; CLFAST_ISA_MATRIX=0 skips
# it), then the whole pytest suite at this CPU's own level.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${CLFAST_SMOKE:-1}" in
  1|0) ;;
  *) echo "CLFAST_SMOKE=$CLFAST_SMOKE: use 1 (the default: the smoke run at the lowest admitted torch) or 0 (skip it)"; exit 1 ;;
esac
case "${CLFAST_ISA_MATRIX:-1}" in
  1|0) ;;
  *) echo "CLFAST_ISA_MATRIX=$CLFAST_ISA_MATRIX: use 1 (the default: the levels below this CPU's) or 0 (skip them)"; exit 1 ;;
esac
# pip's output goes to a log, shown only when an install fails
pip_install() { local venv=$1; shift; "$venv/bin/python" -m pip install -q "$@" >"$venv/pip.log" 2>&1 || { cat "$venv/pip.log"; exit 1; }; }
[ -x .venv/bin/python ] || $PY -m venv .venv
pip_install .venv torch==2.14.1 torchvision==0.29.1
pip_install .venv -e ".[dev]"
# the smoke venv's install (downloading and unpacking, about one core; 226-289 s on Zen 3) runs beside what follows up
# to the smoke run (the nbdev tools' install, the kernel build, the ISA matrix); its output is shown then
if [ "${CLFAST_SMOKE:-1}" = 1 ]; then
  smoke_log=$(mktemp)
  bash tools/smoke_torch.sh install >"$smoke_log" 2>&1 &
  smoke_install=$!
fi
# the CUDA kernels' offline compile report (tests/test_gpu_report.py's: about 1100 compiles, minutes with an empty
# Triton cache) runs in the background at the lowest priority, on what the cores leave idle from here to its tests
# (pip's installs, the kernel build's longest file and most tests keep one core busy, not two), holding a lock while
# it runs; its tests, ordered last (tests/conftest.py), take its report once the lock is free
# (CLFAST_TEST_GPU_REPORT). Stopped when this script ends. In a session of its own (one process group to stop), whose
# scheduler group is niced too: the kernel weighs each session's group alike, so a plain nice in a new session took
# half the CPU (the kernel build 126 -> 357 s)
gpu_report_dir=$(mktemp -d)
export CLFAST_TEST_GPU_REPORT=$gpu_report_dir/report.json
setsid sh -c 'echo 19 > /proc/self/autogroup 2>/dev/null
  exec nice -n 19 flock "$1.lock" env -u TRITON_INTERPRET -u CLFAST_KERNELS .venv/bin/python -m clfast.gpu_report --json "$1"' \
  sh "$CLFAST_TEST_GPU_REPORT" >/dev/null 2>&1 &
gpu_report=$!
trap 'kill -- -$gpu_report 2>/dev/null || true; rm -rf "$gpu_report_dir"' EXIT   # done or not, at this script's end (or failure)
# nbdev v2 (settings.ini) needs fastcore 1.x while fastai needs fastcore 2, so the nbdev tools live in their own venv
[ -x .venv-nbdev/bin/python ] || $PY -m venv .venv-nbdev
pip_install .venv-nbdev -r tools/nbdev-tools.txt
echo "installed: $(.venv/bin/python -c 'import torch, fastai, timm; print("torch", torch.__version__, "fastai", fastai.__version__, "timm", timm.__version__)')"

snapshot() { find nbs clfast README.md -type f \( -name '*.ipynb' -o -name '*.py' -o -name '*.md' \) -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha1sum; }
before=$(snapshot)
.venv-nbdev/bin/nbdev_export
.venv-nbdev/bin/nbdev_clean
.venv/bin/python tools/readme.py
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "FAIL: notebooks, library and README were out of sync; nbdev_export/nbdev_clean/tools/readme.py changed:"
  diff <(echo "$before") <(echo "$after") || true
  exit 1
fi
echo "nbdev sync: notebooks, clfast/ and README.md are in sync"
# clfast's C++ kernels for every level this CPU runs: its own for the suite, the lower ones for the ISA matrix
.venv/bin/clfast build --levels all
# before the suite, whose summary line must end the output: the levels below this CPU's, then the lowest admitted
# torch (after the ISA matrix, so that its install is done by then: before it, the smoke run waited for it where
# the kernels had been built already, as after the README's first command)
if [ "${CLFAST_ISA_MATRIX:-1}" = 1 ]; then .venv/bin/python tools/isa_matrix.py; fi
if [ "${CLFAST_SMOKE:-1}" = 1 ]; then
  wait $smoke_install || { cat "$smoke_log"; echo "FAIL: the smoke venv's install"; exit 1; }
  cat "$smoke_log"; rm -f "$smoke_log"
  bash tools/smoke_torch.sh run
fi
.venv/bin/python -m pytest -q "$@" && rc=0 || rc=$?
exit $rc
