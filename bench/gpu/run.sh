#!/usr/bin/env bash
# GPU check and benchmark of embarkc's generated CUDA kernels: every kernel family against
# the torch path on random data, then bandwidth and speed against torch.nn.EmbeddingBag
# (and FBGEMM's TBE where installed), kernel variants (tune), then the generated trainer of
# a one-GPU spec against its reference (bench/gpu/trainer_check.py). Needs a CUDA GPU with torch and cupy
# (cupy-cuda12x or cupy-cuda13x); no network, no install of this repository (it runs from
# the checkout). For the trainer section, run bench/gpu/prepare.sh first where embarkc is
# installed and carry .whl and bench/gpu/.build to the GPU machine. Then bench/gpu/e2e.py:
# whole training steps of criteo_kaggle on one GPU against a plain PyTorch DLRM
# (EmbeddingBag), at 1, 8 and a mean of 4 ids a feature (its own 4-minute budget). Then
# bench/gpu/host_tier.py: the host tier's cache hits, staged and zero-copy misses against
# the host link's copy bandwidth (its own 5-minute budget).
#
#   bench/gpu/run.sh                      # check + time + tune + trainer, markdown on stdout
#   bench/gpu/run.sh --out bench/gpu/last_run.md
#   bench/gpu/run.sh --sections check     # correctness only
#   bench/gpu/run.sh --allow-no-gpu       # exits 0 on a machine without a GPU
#   bench/gpu/run.sh --no-e2e             # no e2e
#   bench/gpu/run.sh --no-host-tier       # no host tier
#   bench/gpu/run.sh --host-tier-only     # the host tier alone (a few minutes)
#
# Exit code: 0 all checks passed, 1 a check failed, 2 no CUDA device (0 with
# --allow-no-gpu) or an --out that cannot be written, 124 the 5-minute budget ran out
# (what was measured is printed, and is in --out); the kernels' status first, else e2e's
# (1: its two sides' losses disagree), else the host tier's (1: a path's values differ).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
# the wheels bench/gpu/prepare.sh downloaded (pydantic for train.py), when they are needed
. "$here/wheels.sh"
embark_wheels "pydantic"
# bench/gpu/e2e.py after the kernels: whole training steps of criteo_kaggle on one GPU
# against a plain PyTorch DLRM (--no-e2e leaves it out); its table goes beside --out as
# e2e.md (stdout without --out)
args=() out="" e2e=1 host_tier=1 kernels=1 prev=""
for a in "$@"; do
  case "$a" in
    --no-e2e) e2e=0 ;;
    --no-host-tier) host_tier=0 ;;
    --host-tier-only) kernels=0 e2e=0 ;;
    *) args+=("$a") ;;
  esac
  if [ "$prev" = "--out" ]; then out="$a"; fi
  case "$a" in --out=*) out="${a#--out=}" ;; esac
  prev="$a"
done
limit() {  # run "$@" under a wall-clock limit of $1 seconds where timeout exists
  local s="$1"; shift
  if command -v timeout >/dev/null 2>&1; then timeout --foreground "$s" "$@"; else "$@"; fi
}
status=0
if [ "$kernels" = 1 ]; then
  limit 295 "$python" "$here/bench_kernels.py" "${args[@]}"
  status=$?
fi
if [ "$e2e" = 1 ] && [ "$status" -ne 2 ] && [ "$status" -ne 124 ]; then
  e2e_args=()
  if [ -n "$out" ]; then e2e_args+=(--out "$(dirname "$out")/e2e.md"); fi
  case " ${args[*]} " in *" --allow-no-gpu "*) e2e_args+=(--allow-no-gpu) ;; esac
  limit 240 "$python" "$here/e2e.py" "${e2e_args[@]}"
  e2e_status=$?
  if [ "$status" -eq 0 ]; then status=$e2e_status; fi
fi
# bench/gpu/host_tier.py last; its table goes beside --out as host_tier.md
if [ "$host_tier" = 1 ] && [ "$status" -ne 2 ] && [ "$status" -ne 124 ]; then
  ht_args=(--budget 300)
  if [ -n "$out" ]; then ht_args+=(--out "$(dirname "$out")/host_tier.md"); fi
  case " ${args[*]} " in *" --allow-no-gpu "*) ht_args+=(--allow-no-gpu) ;; esac
  limit 330 "$python" "$here/host_tier.py" "${ht_args[@]}"
  ht_status=$?
  if [ "$status" -eq 0 ]; then status=$ht_status; fi
fi
exit "$status"
