#!/usr/bin/env bash
# The suite under the torch and triton of the lent GPU machines, on this CPU, in their venv (tools/gpu_torch_venv.sh,
# with its own Triton, clfast and torch-extensions caches): what a GPU session will import, checked before one is lent
# (session 34 found torch.compile of a fused model broken on 2.11 so). Not part of tools/test.sh (the whole suite again:
# about 30 minutes on 2 cores); arguments go to pytest.
#
#   bash tools/gpu_torch_suite.sh                        # the whole suite
#   bash tools/gpu_torch_suite.sh tests/test_fused.py   # a part
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/gpu_torch_venv.sh
V=.venv-gpu-torch
export TRITON_CACHE_DIR=$PWD/$V/triton-cache CLFAST_CACHE_DIR=$PWD/$V/clfast-cache TORCH_EXTENSIONS_DIR=$PWD/$V/torch-extensions
# test_no_spills: under triton 3.6.0 one sm_80 (A100) specialization keeps an 8-byte stack frame that 3.8.0 does not
# (BENCHMARKS.md, session 34); the lent GPUs are sm_90
exec $V/bin/python -m pytest -q -p no:cacheprovider --deselect tests/test_gpu_report.py::test_no_spills "${@:-tests}"
