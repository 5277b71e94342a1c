#!/usr/bin/env bash
# The first thing to run where a GPU is lent (BENCHMARKS.md, "The first GPU run"): the CUDA tests (the Triton kernels
# against the fp64 oracle, and the offline compile report's registers against the GPU's own JIT), the kernel
# benchmarks (BN+act(+add) forward+backward, fused vs stock: the memory-traffic model's prediction to confirm), and
# resnet50 AMP training, contiguous vs channels-last vs fused, in fp16 and in bf16.
#
#   bash benchmarks/gpu_first_run.sh [OUT]   # PYTHON=python3, STEP_TIMEOUT=0 (none) by default; each step's output in OUT/
#
# Steps run in order and each is logged, whatever the one before did; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu_first_run}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0
STEP_TIMEOUT=${STEP_TIMEOUT:-0}   # seconds per step (0: none), so that one hung step leaves time for the rest
step() {
  local name=$1; shift
  echo "== $name: $*"
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}
step env "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); \
print(torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability(), \
torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
step build "$PY" -c "from clfast import cpu_kernels; print(cpu_kernels.load(verbose=True))"
step cuda-tests "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/
step kernels "$PY" benchmarks/bench_kernels.py --device cuda
for dt in float16 bfloat16; do
  step "resnet50-amp-$dt" "$PY" benchmarks/bench_fused.py --sections gpu --gpu-dtype "$dt"
done
echo "== $failed step(s) failed; logs in $OUT/"
exit "$failed"
