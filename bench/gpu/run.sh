#!/usr/bin/env bash
# GPU check and benchmark of embarkc's generated CUDA kernels: every kernel family against
# the torch path on random data, then bandwidth and speed against torch.nn.EmbeddingBag
# (and FBGEMM's TBE where installed), kernel variants (tune), then the generated trainer of
# a one-GPU spec against its reference (bench/gpu/trainer_check.py). Needs a CUDA GPU with torch and cupy
# (cupy-cuda12x or cupy-cuda13x); no network, no install of this repository (it runs from
# the checkout). For the trainer section, run bench/gpu/prepare.sh first where embarkc is
# installed and carry .whl and bench/gpu/.build to the GPU machine.
#
#   bench/gpu/run.sh                      # check + time + tune + trainer, markdown on stdout
#   bench/gpu/run.sh --out bench/gpu/last_run.md
#   bench/gpu/run.sh --sections check     # correctness only
#   bench/gpu/run.sh --allow-no-gpu       # exits 0 on a machine without a GPU
#
# Exit code: 0 all checks passed, 1 a check failed, 2 no CUDA device (0 with
# --allow-no-gpu) or an --out that cannot be written, 124 the 5-minute budget ran out
# (what was measured is printed, and is in --out).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
# the wheels bench/gpu/prepare.sh downloaded (pydantic for train.py), when they are needed
wheels="$here/../../.whl"
if ! "$python" -c "import pydantic" 2>/dev/null && ls "$wheels"/*.whl >/dev/null 2>&1; then
  site="${TMPDIR:-/tmp}/embark-site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if command -v timeout >/dev/null 2>&1; then
  exec timeout --foreground 295 "$python" "$here/bench_kernels.py" "$@"
fi
exec "$python" "$here/bench_kernels.py" "$@"
