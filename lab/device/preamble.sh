# Sourced by the device scripts: $OUT, START, the GPU's state, the carried wheels on the path.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
SITE=${SITE:-/tmp/site}
rm -rf "$SITE" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD
