# Sourced by the bench scripts: strict mode, $OUT, and the wheels in .whl installed where
# pip cannot fetch (a lent GPU machine), ahead of what is installed.
set -uo pipefail
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
