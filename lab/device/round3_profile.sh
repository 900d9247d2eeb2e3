#!/usr/bin/env bash
# Round 2, second session (2026-12-04): the diagnostic call behind issue 24's c=1 decode step and
# issue 25's warm-before-ready test; carry [".whl"].
#   run(command="bash lab/device/round3_profile.sh", carry=[".whl"])   # ~4 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
TRITON_CACHE_DIR=/tmp/tc-warm timeout 150 python3 -m lab.diagnostics.warmup_new_kernels > "$OUT/warmup_new_kernels.log" 2>&1
grep -v Warning "$OUT/warmup_new_kernels.log" | tail -20
timeout 300 python3 -m lab.diagnostics.decode_c1_profile --formats "${FORMATS:-int4-all,fp8}" --graphs 1,0 \
  --out "$OUT/decode_c1_profile.json" > "$OUT/decode_c1_profile.log" 2>&1
grep -v Warning "$OUT/decode_c1_profile.log" | grep -v "^USDT" | tail -140
