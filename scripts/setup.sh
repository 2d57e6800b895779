#!/usr/bin/env bash
# Creates .venv (once) with embarkc installed editable, its test tools and the `train`
# extra (torch, safetensors, tensorboard, pyarrow: what the generated trainer needs).
# torch is pinned to the local CPU build so that no CUDA build is ever pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import embarkc, torch, lark, ortools, pytest, tensorboard, pyarrow, jsonschema" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test,train]"
fi
