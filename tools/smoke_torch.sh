#!/usr/bin/env bash
# The smoke run at the lowest torch settings.ini admits, in a venv of its own (.venv-torch<version>): clfast installed
# as the README installs it into an existing environment, its kernels built for that torch (`clfast build`), one fused
# training step against fp64 (tools/smoke_step.py) and the demo on 200 digits. tools/test.sh runs it before the suite
# (CLFAST_SMOKE=0 skips it); the whole suite runs at the pinned torch.
# `smoke_torch.sh install` only installs, `smoke_torch.sh run` only runs (tools/test.sh installs beside the kernel
# build: mostly downloading and unpacking, on one core); no argument: both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.4.1 VISION=0.19.1   # settings.ini's floor, and the torchvision built for it
floor=$(grep -o 'torch>=[0-9.]*' settings.ini | cut -d= -f2)
[[ "$TORCH" == "$floor" || "$TORCH" == "$floor".* ]] || { echo "FAIL: tools/smoke_torch.sh runs torch $TORCH, settings.ini admits torch>=$floor: make them agree"; exit 1; }
V=.venv-torch$TORCH
step=${1:-both}
case "$step" in install|run|both) ;; *) echo "usage: tools/smoke_torch.sh [install|run]"; exit 1 ;; esac
t0=$SECONDS
if [ "$step" != run ]; then
  [ -x $V/bin/python ] || $PY -m venv $V
  $V/bin/python -m pip install -q "torch==$TORCH" "torchvision==$VISION" >$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
  $V/bin/python -m pip install -q -e . >>$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
  echo "smoke at the lowest admitted torch: $($V/bin/python -c 'import torch, fastai; print("torch", torch.__version__, "fastai", fastai.__version__)'), installed in $((SECONDS - t0)) s"
fi
[ "$step" = install ] && exit 0
t0=$SECONDS
$V/bin/clfast build
$V/bin/python tools/smoke_step.py
$V/bin/clfast demo --items 200
echo "smoke at torch $TORCH passed in $((SECONDS - t0)) s"
