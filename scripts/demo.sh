#!/usr/bin/env bash
# The main job end to end: check, plan and compile the tiny spec, then train 50 steps on
# 4 CPU processes (gloo) with the generated trainer, through its launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
embarkc check specs/tiny.embark
embarkc plan specs/tiny.embark -o build/tiny-plan.json
embarkc compile specs/tiny.embark -o build/tiny
# launch.sh checks the options in one process, then runs torchrun: all 4 ranks here
NNODES=1 NPROC_PER_NODE=4 build/tiny/launch.sh --steps 50
