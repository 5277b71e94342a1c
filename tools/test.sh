#!/usr/bin/env bash
# clfast's test command: installs what the tests need into .venv, checks that notebooks, library and README are in
# sync (nbdev_export / nbdev_clean / tools/readme.py change nothing), builds the C++ kernels for every level this CPU
# runs, then runs the whole pytest suite at this CPU's own level. Beside the suite, at the lowest priority: the smoke
# run at the lowest torch settings.ini admits (tools/smoke_torch.sh; CLFAST_SMOKE=0 skips it) and the numerics tests
# at each instruction-set level below this CPU's (tools/isa_matrix.py; CLFAST_ISA_MATRIX=0 skips it), whose outcomes
# tests/test_beside.py waits for and reports, last, so that pytest's summary line ends the output and counts them.
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
# What runs beside the suite, on what the cores leave idle (pytest keeps about 1.2-1.5 of the 2 busy; pip's installs
# and the kernel build's longest file, one): each in a session of its own (one process group to stop) whose scheduler
# group is niced, for the kernel weighs each session's group alike (a plain nice in a new session took half the CPU:
# the kernel build 126 -> 357 s). All are stopped when this script ends, done or not
beside_dir=$(mktemp -d)
beside_groups=()
trap 'for g in "${beside_groups[@]}"; do kill -- -$g 2>/dev/null || true; done; rm -rf "$beside_dir"' EXIT
# the smoke run and the ISA matrix (5.4-5.7 min before the suite, on a Zen 3 and a Zen 4, sessions 58-59): each writes
# NAME.log, then its exit status NAME.rc, here; tests/test_beside.py waits for them, ordered last (tests/conftest.py)
export CLFAST_TEST_BESIDE=$beside_dir/beside
mkdir "$CLFAST_TEST_BESIDE"
beside() {   # beside NAME COMMAND...
  setsid sh -c 'echo 19 > /proc/self/autogroup 2>/dev/null; out=$1; shift
    env -u CLFAST_TEST_BESIDE nice -n 19 "$@" >"$out.log" 2>&1; echo $? >"$out.rc.part"; mv "$out.rc.part" "$out.rc"' \
    sh "$CLFAST_TEST_BESIDE/$1" "${@:2}" &
  beside_groups+=($!)
}
# the smoke venv's install (downloading and unpacking, about one core; 179-289 s), then its run
if [ "${CLFAST_SMOKE:-1}" = 1 ]; then beside smoke bash tools/smoke_torch.sh; fi
# the CUDA kernels' offline compile report (tests/test_gpu_report.py's: about 1100 compiles, minutes with an empty
# Triton cache), holding a lock while it runs; its tests, ordered last, take its report once the lock is free
export CLFAST_TEST_GPU_REPORT=$beside_dir/report.json
setsid sh -c 'echo 19 > /proc/self/autogroup 2>/dev/null
  exec nice -n 19 flock "$1.lock" env -u TRITON_INTERPRET -u CLFAST_KERNELS .venv/bin/python -m clfast.gpu_report --json "$1"' \
  sh "$CLFAST_TEST_GPU_REPORT" >/dev/null 2>&1 &
beside_groups+=($!)
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
if [ "${CLFAST_ISA_MATRIX:-1}" = 1 ]; then beside isa_matrix .venv/bin/python tools/isa_matrix.py; fi
.venv/bin/python -m pytest -q "$@" && rc=0 || rc=$?
exit $rc
