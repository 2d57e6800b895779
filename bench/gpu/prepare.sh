#!/usr/bin/env bash
# Prepare, on a machine with embarkc installed (this repository's .venv), what the GPU
# machine lacks for bench/gpu/run.sh's trainer section:
#   * bench/gpu/.build/tiny1: bench/gpu/tiny1.embark compiled (train.py, plan.json,
#     kernels/), since the GPU machine has no lark or ortools to compile it, and
#     bench/gpu/.build/e2e_*: bench/gpu/e2e.py's variants of criteo_kaggle on one GPU;
#   * .whl/: pydantic's (and lark's) wheels for the GPU machine's Python (3.12, x86-64), which train.py
#     needs to read plan.json and which that machine's image does not hold.
# Both are git-ignored; pass them to the device tool as carry: [".whl", "bench/gpu/.build"].
#
#   bench/gpu/prepare.sh [--python-version 3.12]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
pyver="3.12"
if [ "${1:-}" = "--python-version" ]; then pyver="$2"; fi
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
"$python" -m embarkc.cli compile bench/gpu/tiny1.embark -o bench/gpu/.build/tiny1 -q
"$python" bench/gpu/e2e.py --prepare   # bench/gpu/.build/e2e_{h1,h8,multi}
rm -rf .whl
mkdir -p .whl
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions lark; do
  version="$("$python" -c "import importlib.metadata as m; print(m.version('$pkg'))")"
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg==$version"
done
ls .whl
echo "ready: carry .whl and bench/gpu/.build, then run bench/gpu/run.sh"
