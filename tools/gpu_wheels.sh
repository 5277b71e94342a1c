#!/usr/bin/env bash
# The wheels a device machine lacks (fastai and what it imports that the machine's image does not hold: its list is in
# /work/.library/device/KINDS.md), downloaded for its Python 3.12 into .whl/ (ignored by git through .git/info/exclude),
# at the versions this checkout's .venv holds, except fastprogress: 1.0.3, the last that does not import fasthtml (whose
# web stack the machine lacks). Then clfast's C++ kernels for the machines' torch, every level, into .whl/kernels/:
# benchmarks/gpu_first_run.sh loads them there instead of compiling (60-90 s of the lease). Carry `.whl` and install
# them there first (BENCHMARKS.md, "The first GPU run"). Run it again after changing csrc/: kernels built from other
# sources do not load (their name holds the sources' hash), and the machine compiles its own.
#
#   bash tools/gpu_wheels.sh             # wheels and kernels (the kernels: about 4 minutes on 2 cores)
#   CLFAST_GPU_KERNELS=0 bash tools/gpu_wheels.sh   # the wheels alone
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -f .whl/*.whl
for name in fastai fastcore fastprogress fasttransform plum-dispatch beartype fastdownload; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
  [ "$name" = fastprogress ] && version=1.0.3
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "$name==$version" 2>&1 | grep -v '^WARNING' || true
done
ls .whl

# the kernels: setup.py's wheel build (CLFAST_BUILD_KERNELS=all: every level, the machine's CPU is not known here) under
# the machines' torch, in a copy of what it reads from this working tree, so that the checkout gets no library of
# another torch; the build's output (compiler warnings by the thousand, megabytes) is shown only when it fails
rm -rf .whl/kernels
if [ "${CLFAST_GPU_KERNELS:-1}" = 1 ]; then
  bash tools/gpu_torch_venv.sh
  copy=$(mktemp -d)
  cp -r setup.py settings.ini README.md clfast "$copy"
  rm -rf "$copy"/clfast/_kernels_* "$copy"/clfast/__pycache__
  mkdir -p .whl/kernels
  (cd "$copy" && CLFAST_BUILD_KERNELS=all "$OLDPWD/.venv-gpu-torch/bin/python" setup.py -q build_ext --inplace) \
    >"$copy.log" 2>&1 || { tail -40 "$copy.log"; rm -rf "$copy" "$copy.log"; exit 1; }
  grep '^clfast:' "$copy.log"
  cp "$copy"/clfast/_kernels_*.so .whl/kernels/
  rm -rf "$copy" "$copy.log"
  ls .whl/kernels
fi
