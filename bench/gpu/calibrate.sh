#!/usr/bin/env bash
# Issue 37's GPU check in one command: calibrate this GPU (lookups through the generated
# kernels, CUDA events), plan bench/gpu/tiny1.embark with the hardware file it writes,
# train it with --measure-phases and set the plan beside the run (`embarkc measured`).
# bench/gpu/calibrate_check.py has the steps. Before, where embarkc is installed, run
# bench/gpu/prepare.sh and carry .whl (pydantic and lark for the GPU machine's Python).
#
#   bench/gpu/calibrate.sh [--quick] [--steps 30] [--out bench/gpu/calibrated]
#   bench/gpu/calibrate.sh --device cpu --quick --steps 4   # the CPU dry run
#
# Exit code: calibrate_check.py's (0 it ran, 2 it cannot run here), 124 past 9 minutes.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
. "$here/wheels.sh"
embark_wheels "pydantic, lark"
if command -v timeout >/dev/null 2>&1; then
  exec timeout --foreground 540 "$python" "$here/calibrate_check.py" "$@"
fi
exec "$python" "$here/calibrate_check.py" "$@"
