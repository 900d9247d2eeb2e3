# Sourced by the device scripts: $OUT, START, `el` (seconds since) and `fits` (whether a stage of $1 s ends
# before $LIMIT), the GPU's state, the carried wheels on the path (NO_WHL=1: all but the last two, the
# caller's packages, as the scripts' CPU dry runs use).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
el() { echo $(( $(date +%s) - START )); }  # seconds since the preamble
# a stage starts only if its timeout ($1 s) ends before the caller's $LIMIT s; $2 names it
fits() { [ $(( $(el) + $1 )) -le "$LIMIT" ] || { echo "== skipped: $2 (${1} s would pass ${LIMIT} s at $(el) s)"; return 1; }; }
if [ -n "${NO_WHL:-}" ]; then  # a CPU dry run (or wheels already installed): the venv's own packages
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
  return 0
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
SITE=${SITE:-/tmp/site}
rm -rf "$SITE" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD
