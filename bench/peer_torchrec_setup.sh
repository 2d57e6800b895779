#!/usr/bin/env bash
# Creates a separate virtual environment with TorchRec for bench/peer_torchrec.py.
#
#   bash bench/peer_torchrec_setup.sh [VENV]      # default /tmp/embark-torchrec-venv ($EMBARK_TORCHREC_VENV)
#   VENV/bin/python bench/peer_torchrec.py
#
# TorchRec is kept out of the project's own environment: it pins its own fbgemm build, and
# fbgemm-gpu-cpu must match torch exactly (1.9 does not load with torch 2.13). The versions
# below are the combination known to work on Python 3.11. torchrec is installed with
# --no-deps because its declared requirements would pull a CUDA fbgemm and another torch;
# its real run-time imports are the short list installed after it. The repository itself
# (embarkc and embark_runtime) is installed editable with its own dependencies, so the peer
# bench draws exactly the same synthetic batches as bench/runtime_cpu.py and times
# embarkc's planner next to TorchRec's in the same interpreter; torch stays at 2.13.0
# because the project only asks for torch>=2.2.
set -euo pipefail

VENV="${1:-${EMBARK_TORCHREC_VENV:-/tmp/embark-torchrec-venv}}"
PYTHON="${PYTHON:-python3.11}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    PYTHON=python3
fi
"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"peer_torchrec_setup.sh: Python 3.11 is needed (found {sys.version.split()[0]}); set PYTHON=")
PY

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0"
# --no-deps: torchrec 1.8.0 declares fbgemm-gpu (the CUDA build); pip then warns that it is
# missing, which is expected: fbgemm-gpu-cpu provides the same fbgemm_gpu package.
"${PIP[@]}" --no-deps "torchrec==1.8.0"
"${PIP[@]}" "tensordict==0.15.3" "torchmetrics==1.0.3" tqdm pyre-extensions numpy pydantic
"${PIP[@]}" -e "$REPO"

"$VENV/bin/python" - <<'PY'
import fbgemm_gpu  # noqa: F401  (registers the CPU operators TorchRec calls)
import torch
import torchrec
import embark_runtime.synthetic  # noqa: F401
import embarkc.planner  # noqa: F401

from importlib.metadata import version

print(f"ok: torch {torch.__version__}, torchrec {version('torchrec')}, fbgemm-gpu-cpu {version('fbgemm-gpu-cpu')}")
PY
echo "TorchRec environment ready: $VENV/bin/python bench/peer_torchrec.py"
