#!/usr/bin/env bash
# The one GPU script (BENCHMARKS.md, "The first GPU run"), inside one device call of 10 minutes, the one call a
# session's 15 minutes of device time leave room for (a machine's start takes one to two of them): the C++ library
# (fused modules load it when they are made, for CPU models; CUDA's eager step no longer goes through it; first, so
# that no test pays for it: the one tools/gpu_wheels.sh built for this torch where it loads, else compiled here),
# Triton's cache filled with the kernels' specializations for this GPU in one process per core (`python -m
# clfast.gpu_report --warm-only CC`: about 25 s; it serves the launches where their cache keys are the offline
# compile's, which a CUDA test checks, and the tests' and the fit's compile counts show), the CUDA tests (the Triton
# kernels and CUDA graphs against fp64, the offline compile report against the GPU's own JIT; each failure's
# traceback kept), training through fastai's own `Learner.fit` for at most FIT_S seconds (benchmarks/bench_gpu_fit.py:
# every setup issue 34 names, in rounds, the table last and issue 34's done-when read off it; by default fp16 at batch
# 256, where the row the last GPU run left short is: 'memory', 0.82x stock eagerly), then with what is left where a
# fused layer step's host time goes (benchmarks/probe_host_time.py: synchronizations, CUDA runtime calls, Python's own
# time per function), a fused layer step's host time against stock's (`python -m clfast.host_cost --device cuda`,
# Triton's launches included; then a whole resnet50 'memory' step's, `--model resnet50 --mode memory`), the kernels'
# tilings against the default (benchmarks/sweep_kernel_tiles.py: each pass's fraction of a copy's bandwidth, issue 34 item 5)
# and the kernel benchmarks against stock cuDNN.
#
#   bash benchmarks/gpu_first_run.sh [OUT [STEP ...]]   # STEPs: build warm tests fit probe host tiles kernels
#                                                       # (default: all, in that order)
#
# BUDGET (seconds, 540) bounds the whole run; TESTS_S (150) the tests; FIT_S (200) the fit where steps follow it (else
# what is left); FIT_ARGS (default "--dtypes float16 --bs 256") go to bench_gpu_fit.py (e.g. "--models
# efficientnet_b0": the groups no run has measured yet first; FIT_ARGS="" every group). fastai travels as wheels in
# .whl/, the kernels in .whl/kernels/ (tools/gpu_wheels.sh); the wheels are installed here into /tmp/site when fastai
# is missing. Each step is logged in OUT/ whatever the one before did; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu_first_run}; shift || true
STEPS=${*:-build warm tests fit probe host tiles kernels}
BUDGET=${BUDGET:-540}; TESTS_S=${TESTS_S:-150}; FIT_S=${FIT_S:-200}; FIT_ARGS=${FIT_ARGS---dtypes float16 --bs 256}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c 'import fastai' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
failed=0 carried=()
trap 'rm -f "${carried[@]}"' EXIT
left() { echo $((BUDGET - SECONDS)); }
step() {   # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (at most ${limit}s): $*"
  # SIGINT first: pytest then prints its summary (failures, tracebacks) and the fit its table; killed 20 s later
  # (a log per name before any ':': setup:env and setup:build share one, the two test steps one, the tiling sweep and the
  # kernel bench one: 7 logs, since only 8 files come back from a device call)
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$OUT/${name%%:*}.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after ${SECONDS}s in all"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}
step setup:env 60 "$PY" -c "import torch, triton, fastai; print('torch', torch.__version__, 'triton', triton.__version__, \
'fastai', fastai.__version__); print(torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability(), \
torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
for s in $STEPS; do
  case $s in
    build)
      # the kernels built for this torch elsewhere (tools/gpu_wheels.sh), into the package where `load` looks first,
      # if they load here (else they go, and the build compiles); taken out again when this script ends
      for f in .whl/kernels/_kernels_*.so; do [ -e "$f" ] && cp "$f" clfast/ && carried+=("clfast/${f##*/}"); done
      if [ ${#carried[@]} -gt 0 ] && ! "$PY" -c "import torch; from clfast import cpu_kernels as c
p, why = c.installed_library(); assert p, why; torch.ops.load_library(str(p)); print('carried kernels:', p.name)"; then
        echo "the carried kernels do not load here: compiled instead"; rm -f "${carried[@]}"; carried=()
      fi
      step setup:build 150 "$PY" -c "from clfast import cpu_kernels; print(cpu_kernels.load(verbose=True))" ;;
    warm)
      if cc=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null); then
        step warm 90 "$PY" -m clfast.gpu_report --warm-only "$cc" --processes "$(nproc)"
      else echo "== warm: not run (no CUDA GPU here)"; fi ;;
    # the CUDA tests in two steps: first, alone on the GPU, those that time it or the host (the clocks, a layer step's
    # host time, the offline compile against the GPU's JIT); then the rest in parallel processes where pytest-xdist is
    # there (the machines' image has it): most of their time is Triton compiling specializations (342 in 117 s in one
    # process on the H200), which the host's cores do side by side
    tests)
      t0=$SECONDS
      step cuda-tests:timed "$(( $(left) < TESTS_S ? $(left) : TESTS_S ))" "$PY" -m pytest -q -p no:cacheprovider -rfE \
        --tb=short --durations=5 -m cuda tests/test_timing.py tests/test_host_cost.py tests/test_gpu_report.py
      rest=$(( TESTS_S - (SECONDS - t0) )); [ "$rest" -gt "$(left)" ] && rest=$(left)
      workers=$("$PY" -c 'import os, xdist; print(max(2, min(8, os.cpu_count() // 2)))' 2>/dev/null) || workers=
      if [ "$rest" -gt 20 ]; then
        step cuda-tests:parallel "$rest" "$PY" -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=10 -m cuda \
          ${workers:+-n "$workers"} $(ls tests/test_*.py | grep -v -e test_timing -e test_host_cost -e test_gpu_report)
      else echo "== cuda-tests: not run (${rest}s of TESTS_S left)"; fi ;;
    # the fit: groups started until `--budget` (a group runs on past it, about 45 s), stopped at the step's limit (SIGINT:
    # it still prints its table): FIT_S where steps follow it, else what is left
    fit) lim=$(( $(left) - 10 ))
         case " $STEPS " in *" fit "[a-z]*) [ "$lim" -gt "$FIT_S" ] && lim=$FIT_S ;; esac
         if [ "$lim" -gt 60 ]; then step fit "$lim" "$PY" benchmarks/bench_gpu_fit.py --budget "$(( lim - 50 ))" $FIT_ARGS
         else echo "== fit: not run ($(left)s left)"; fi ;;
    # host: Triton's launch both ways (its own, the compiled kernels'), and its first compiles of these shapes; then a
    # whole resnet50's 'memory' step both ways (2 images of 32 px: host-bound), the one fit row the goal still lacks eagerly
    host) if [ "$(left)" -gt 60 ]; then step host 55 "$PY" -m clfast.host_cost --device cuda --pairs 50
          else echo "== host: not run ($(left)s left)"; fi
          if [ "$(left)" -gt 75 ]; then step host:model 60 "$PY" -m clfast.host_cost --device cuda --model resnet50 --mode memory --pairs 15
          else echo "== host:model: not run ($(left)s left)"; fi ;;
    # probe: where a fused layer step's host time goes (1.5-1.9x stock's on the H200, session 55: no synchronization,
    # Triton's launches from Python the largest term), each way forced, bf16 and fp32 (about 30 s; the questions of
    # benchmarks/probe_slow_gpu_rows.py, fp16's 'memory' and eager 'speed' at batch 64, were answered there: the host)
    probe) if [ "$(left)" -gt 60 ]; then step probe "$(( $(left) - 25 < 90 ? $(left) - 25 : 90 ))" "$PY" benchmarks/probe_host_time.py --steps 100
           else echo "== probe: not run ($(left)s left)"; fi ;;
    # tiles: each tiling setting on either side of the default, then the best together (its own compiles first, in a
    # process per core); it stops starting shapes at its --budget and prints what it measured
    tiles) lim=$(( $(left) - 25 < 100 ? $(left) - 25 : 100 ))
           if [ "$lim" -gt 40 ]; then step kernels:tiles "$lim" "$PY" benchmarks/sweep_kernel_tiles.py --budget "$(( lim - 15 ))"
           else echo "== tiles: not run ($(left)s left)"; fi ;;
    kernels) lim=$(( $(left) - 5 < 60 ? $(left) - 5 : 60 ))
             if [ "$lim" -gt 30 ]; then step kernels:bench "$lim" "$PY" benchmarks/bench_kernels.py --device cuda --reps 3
             else echo "== kernels: not run ($(left)s left)"; fi ;;
    *) echo "unknown step $s (build, warm, tests, fit, probe, host, tiles, kernels)"; failed=$((failed + 1)) ;;
  esac
done
echo "== $failed step(s) failed in ${SECONDS}s; logs in $OUT/"
exit "$failed"
