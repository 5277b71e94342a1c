#!/usr/bin/env bash
# The wheels a device machine lacks (fastai and what it imports that the machine's image does not hold: its list is in
# /work/.library/device/KINDS.md), downloaded for its Python 3.12 into .whl/ (ignored by git through .git/info/exclude),
# at the versions this checkout's .venv holds, except fastprogress: 1.0.3, the last that does not import fasthtml (whose
# web stack the machine lacks). Carry `.whl` and install them there first (BENCHMARKS.md, "The first GPU run").
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
