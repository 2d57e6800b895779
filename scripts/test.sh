#!/usr/bin/env bash
# The test command: lint, type-check and the whole test suite. Fails when anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
ruff check embarkc runtime tests bench
ruff format --check embarkc runtime tests bench
mypy embarkc
python -m pytest -q "$@"
