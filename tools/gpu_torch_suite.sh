#!/usr/bin/env bash
# The suite under the torch and triton of the lent GPU machines (BENCHMARKS.md: torch 2.11.0+cu130, triton 3.6.0), on
# this CPU, in a venv of its own (.venv-gpu-torch, with its own Triton, clfast and torch-extensions caches): what a GPU
# session will import, checked before one is lent (session 34 found torch.compile of a fused model broken on 2.11 so).
# Not part of tools/test.sh (the whole suite again: about 30 minutes on 2 cores); arguments go to pytest.
#
#   bash tools/gpu_torch_suite.sh                        # the whole suite
#   bash tools/gpu_torch_suite.sh tests/test_fused.py   # a part
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.11.0 VISION=0.26.0   # the GPU machines' torch (PyPI's CUDA build; it brings triton 3.6.0), its torchvision
V=.venv-gpu-torch
[ -x $V/bin/python ] || $PY -m venv $V
# numpy below 2.3: triton 3.6.0's interpreter (the Triton kernels' numerics tests) fails with numpy 2.4
$V/bin/python -m pip install -q "torch==$TORCH" "torchvision==$VISION" "numpy<2.3" >$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
$V/bin/python -m pip install -q -e ".[dev]" "numpy<2.3" >>$V/pip.log 2>&1 || { cat $V/pip.log; exit 1; }
echo "gpu torch: $($V/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
export TRITON_CACHE_DIR=$PWD/$V/triton-cache CLFAST_CACHE_DIR=$PWD/$V/clfast-cache TORCH_EXTENSIONS_DIR=$PWD/$V/torch-extensions
# test_no_spills: under triton 3.6.0 one sm_80 (A100) specialization keeps an 8-byte stack frame that 3.8.0 does not
# (BENCHMARKS.md, session 34); the lent GPUs are sm_90
exec $V/bin/python -m pytest -q -p no:cacheprovider --deselect tests/test_gpu_report.py::test_no_spills "${@:-tests}"
