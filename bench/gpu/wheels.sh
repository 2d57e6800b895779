# Sourced by bench/gpu/run.sh and calibrate.sh: where $python lacks the modules named in
# $1 (pydantic for train.py, lark for embarkc), install the wheels bench/gpu/prepare.sh
# downloaded into .whl/ under $TMPDIR and put them on PYTHONPATH.
embark_wheels() {
  local wheels="$here/../../.whl"
  if ! "$python" -c "import $1" 2>/dev/null && ls "$wheels"/*.whl >/dev/null 2>&1; then
    local site="${TMPDIR:-/tmp}/embark-site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
}
