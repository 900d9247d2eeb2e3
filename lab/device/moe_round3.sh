#!/usr/bin/env bash
# Round 3, issue 24's INT4 decode rows (fused MoE M=1..64, W4A16 M=1), one call, ~5 min; carry [".whl"]
# (lab/device/device_plan.sh's cp312 wheels: the kernel tests import backend modules that need msgspec).
#   run(command="bash lab/device/moe_round3.sh moe", carry=[".whl"])
# 1. lab/diagnostics/moe_round3_sweep.py: old launcher configs vs pipelined / expert-ordered candidates,
#    alternating rounds x3, copy bandwidth at the start and the end of the same run, ~3 min;
# 2. the INT4 kernels' gpu tests (fused MoE incl. the new GEMV variants and moe_align's fixed variants,
#    W4A16, int4_linear), <= 95 s.
# The last lines printed: the sweep's table (per case every candidate's median us, spread, GB/s,
# fraction of copy, error; "=> best ..." per case) and the test summary. $OUT: moe_round3.json, logs.
set -uo pipefail
stage=${1:?moe}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
if [ -d .whl ]; then
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
summary() { for f in "$@"; do echo "== $f"; grep -E "passed|failed|FAILED|^ERROR| FAIL |Timeout" "$OUT/$f" | tail -25; done; }
case $stage in
  moe)  # the sweep first (it checks every candidate against the fp32 reference itself), then the tests
    timeout 200 python3 -m lab.diagnostics.moe_round3_sweep --out "$OUT/moe_round3.json" > "$OUT/moe_round3.log" 2>&1
    timeout 95 python3 -m pytest -m gpu -n 4 -p no:cacheprovider -p no:benchmark --tb=short --timeout 90 -rfE \
      tests/kernels/test_fused_moe.py tests/kernels/test_w4a16_gemm.py tests/kernels/test_int4_linear.py \
      > "$OUT/pytest_gpu_int4.log" 2>&1
    grep -vE "Warning|warn" "$OUT/moe_round3.log" | tail -n 90
    summary pytest_gpu_int4.log
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
