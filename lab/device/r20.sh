#!/usr/bin/env bash
# Session 20's H100 call (<= ~560 s): first the GPU tests that never ran on a GPU (the warm-up's
# calibration, the speculative and staging CUDA tests, the decode graphs, the MLA decode kernels), then
# the mtp bench calibrated vs not (issue 28: c=1 and c=64, on / off) as r19.sh, with what time is left.
# Everything in $OUT/r20.tgz, packed after each stage.
#   run(command="timeout -s KILL 590 bash lab/device/r20.sh", carry=[".whl"], timeout_s=600)
# Call 2: TESTS=tests/kernels/test_mla_decode.py K="tile_variants_match_reference or tampered_and_sparse or
#   replays_in_a_cuda_graph" TESTS_S=150 VARIANTS=cal BUDGET=200 (the MLA tests call 1 had no time for)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r20 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r20.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-150}
WAVES=${WAVES:-3}
# TESTS: the test files, K: a -k expression (call 1 ran these files; it timed out in test_mla_decode.py's last 8)
TESTS=${TESTS:-tests/backend/server/test_warmup.py tests/backend/engine/test_speculative_cuda.py \
  tests/backend/engine/test_staging_cuda.py tests/backend/engine/test_speculative_calibration.py \
  tests/backend/engine/test_decode_graphs_cuda.py tests/kernels/test_mla_decode.py}
# shellcheck disable=SC2086  # TESTS is a list of arguments
timeout ${TESTS_S:-230} python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE $TESTS ${K:+-k "$K"} > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR" $W/pytest.log | tail -12
pack
for variant in ${VARIANTS:-cal nocal}; do
  flag=""; [ "$variant" = nocal ] && flag="--no-calibrate"
  fits $(( BUDGET + 50 )) "mtp bench $variant" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
    --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-3} --budget-s "$BUDGET" --c64-waves "$WAVES" $flag \
    --out $W/mtp-$variant.json > $W/mtp-$variant.log 2>&1
  echo "== mtp bench $variant rc=$? at $(el)s"; grep -v Warning $W/mtp-$variant.log | grep -E "speedup|c64|refused|Error|error" | head -12
  python3 -m lab.diagnostics.mtp_runs $W/mtp-$variant.json 2>&1 | head -40
  pack
done
echo "== done at $(el)s"
