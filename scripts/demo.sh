#!/usr/bin/env bash
# The main job end to end: check, plan and compile the tiny spec, then train 50 steps on
# 4 CPU processes (gloo) with the generated trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
embarkc check specs/tiny.embark
embarkc plan specs/tiny.embark -o build/tiny-plan.json
embarkc compile specs/tiny.embark -o build/tiny
torchrun --standalone --nproc-per-node 4 build/tiny/train.py --steps 50
