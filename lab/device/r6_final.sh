#!/usr/bin/env bash
# Session 6's last call on one H200 (carry [".whl"]), ≤ ~370 s: the GPU tests of the new W4A16 decode
# GEMV and of the greedy speculative step (side by side on GPU 0), then `kumo bench engine mtp` in
# what is left, then decode-c1 int4-all if time remains. Everything in $OUT/r6_final.tgz.
#   run(command="bash lab/device/r6_final.sh", carry=[".whl"], timeout_s=420)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r6f && rm -rf $W && mkdir -p $W
LIMIT=${LIMIT:-370}
( timeout 130 python3 -m pytest -n 6 -p no:cacheprovider -p no:benchmark --tb=short --timeout 120 -rfE \
    tests/kernels/test_w4a16_gemm.py tests/backend/quant/test_quant_decode_cuda.py > $W/pytest_w4a16.log 2>&1 ) &
( timeout 130 python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 120 -rfE \
    tests/backend/engine/test_speculative_cuda.py > $W/spec_gpu.log 2>&1 ) &
wait
echo "== w4a16 tests at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/pytest_w4a16.log | tail -12
echo "== spec gpu tests"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/spec_gpu.log | tail -12
tar czf "$OUT/r6_final.tgz" -C $W .
budget=$(( LIMIT - $(el) - 110 ))
if [ "$budget" -gt 90 ]; then
  timeout $(( budget + 40 )) python3 -m benchmarks.cli engine mtp --budget-s "$budget" --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
  echo "== mtp bench rc=$? at $(el)s (budget ${budget}s)"; grep -v Warning $W/mtp-gpu.log | tail -30
fi
tar czf "$OUT/r6_final.tgz" -C $W .
left=$(( LIMIT - $(el) ))
if [ "$left" -gt 80 ]; then
  timeout $(( left - 5 )) python3 -m benchmarks.cli engine decode-c1 --formats int4-all --budget-s $(( left - 30 )) \
    --out $W/decode-c1-int4-all.json > $W/decode-c1.log 2>&1
  echo "== decode-c1 int4-all rc=$? at $(el)s"; grep -v Warning $W/decode-c1.log | tail -6
fi
tar czf "$OUT/r6_final.tgz" -C $W .
echo "== done at $(el)s"
