#!/usr/bin/env bash
# Issue 24, MLA decode rows (round 3, 2026-12-04): one H200 call per stage, each inside the 10-minute limit;
# carry [".whl"] when the checkout has it (pytest-xdist for -n; nothing else is needed).
#   run(command="bash lab/device/mla_round3.sh all", carry=[".whl"])   # <= 8 min: tests, then the A/B
#   run(command="bash lab/device/mla_round3.sh ab")      # <= 5 min: lab.diagnostics.mla_ab alone (its docstring;
#       no case starts after AB_BUDGET s, default 240: batch 64 first, then 8, then 1)
#   run(command="bash lab/device/mla_round3.sh tests")   # <= 3 min: the MLA kernels' gpu tests
#   run(command="bash lab/device/mla_round3.sh bench")   # ~3 min: the product bench (--no-sweep, decode),
#       after a winner is pasted into kernels.mla_tiles.TILES: the rows for benchmarks/results
#   run(command="bash lab/device/mla_round3.sh tagcheck")  # ~2 min: the tag check's A/B rows (7 pairs)
# What to read: the last table of the A/B (per case µs and fraction of copy, BF16 and FP8, old and best
# new; "fp8÷bf16" old and best: the goal is >= 1.8 at 8 and 16 heads with FP8 >= 0.85 of copy; 64 heads:
# TFLOP/s, BF16 >= 400, FP8 >= 1.3x BF16), then per table key the variants ranked against `new` and the
# TILES line to paste. Logs and JSON land in $OUT.
set -uo pipefail
stage=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
if compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6" || echo "")

gpu_tests() {
  # -p no:benchmark: the image's pytest-benchmark warns under xdist (an INTERNALERROR with filterwarnings=error)
  timeout 180 python3 -m pytest -m gpu $workers -p no:cacheprovider -p no:benchmark --tb=short -rfE -q \
    tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py tests/kernels/test_tag_check_off.py \
    tests/kernels/test_paged_decode_gqa.py > "$OUT/pytest_gpu_mla.log" 2>&1
  grep -E "passed|failed|FAILED|^ERROR" "$OUT/pytest_gpu_mla.log" | tail -20
}

ab() {
  timeout 330 python3 -m lab.diagnostics.mla_ab --budget-s "${AB_BUDGET:-240}" --out "$OUT/mla_ab.json" 2>&1 | grep -v Warning > "$OUT/mla_ab.log"
  grep -vE "^timed |^ceilings" "$OUT/mla_ab.log" | tail -40
}

case $stage in
  all) gpu_tests; ab ;;
  tests) gpu_tests ;;
  ab) ab ;;
  bench)
    timeout 420 python3 -m benchmarks.kernels.bench_mla_decode --parts decode --out "$OUT/mla_decode.json" 2>&1 \
      | grep -v Warning | tee "$OUT/bench_mla_decode.log" | tail -25
    ;;
  tagcheck)
    timeout 420 python3 -m benchmarks.kernels.bench_mla_decode --tag-check --out "$OUT/mla_tag_check.json" 2>&1 \
      | grep -v Warning | tee "$OUT/bench_mla_tag_check.log" | tail -10
    ;;
  *) echo "stage: all | tests | ab | bench | tagcheck" >&2; exit 2 ;;
esac
