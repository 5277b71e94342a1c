#!/usr/bin/env bash
# .venv-gpu-torch: the torch and triton of the lent GPU machines (BENCHMARKS.md: torch 2.11.0+cu130, triton 3.6.0) on
# this CPU, with clfast installed editable. Made or brought up to date here; used by tools/gpu_torch_suite.sh (the
# suite under that torch) and tools/gpu_wheels.sh (clfast's C++ kernels built for that torch). PyPI's CUDA build: a
# first install downloads several GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.11.0 VISION=0.26.0   # the GPU machines' torch (it brings triton 3.6.0), its torchvision
V=.venv-gpu-torch
[ -x $V/bin/python ] || $PY -m venv $V
# numpy below 2.3: triton 3.6.0's interpreter (the Triton kernels' numerics tests) fails with numpy 2.4
$V/bin/python -m pip install -q "torch==$TORCH" "torchvision==$VISION" "numpy<2.3" >$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
$V/bin/python -m pip install -q -e ".[dev]" "numpy<2.3" >>$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
echo "gpu torch: $($V/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
