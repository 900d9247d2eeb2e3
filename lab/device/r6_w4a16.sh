#!/usr/bin/env bash
# Issue 24, W4A16 at decode (branch r6-kernel24): the TMA-streamed GEMV against the old one, one call
# (~5 min; carry [".whl"]):
#   run(command="bash lab/device/r6_w4a16.sh", carry=[".whl"], timeout_s=360)
# 1. the W4A16 tests on the GPU (bf16 on real shapes: the TMA ring, M=2 on one stream, the prefetch
#    variant, the transposed tiles, split-K; the sm90 compile check) and the quantized decode step on
#    CUDA (int4-all through the kernels, no per-step dequantization);
# 2. the c=1 decode step with every Linear INT4 on the new default (was 3.90 ms a step, 10 layers);
# 3. the decode sweep (lab/diagnostics/w4a16_decode_sweep.py) in the time left: old vs new alternated
#    A B B A over 4 rounds, the TMA / prefetch candidates, FP8 `_scaled_mm`, cuBLAS bf16 and copy in the
#    same run, on the benchmark's matrices and one GLM 5.2 layer's (µs per candidate: sets the
#    launcher's GEMV_DEFAULT / GEMV_NARROW / TMA_PROGRAMS_PER_SM), M=2, and M=16 with the transposed
#    tiles (`swap_xw`, the stretch row).
# Everything in $OUT/r6_w4a16.tgz.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r6w && rm -rf $W && mkdir -p $W
timeout 120 python3 -m pytest -n 8 -p no:cacheprovider -p no:benchmark --tb=short --timeout 110 -rfE \
  tests/kernels/test_w4a16_gemm.py tests/backend/quant/test_quant_decode_cuda.py > $W/pytest_w4a16.log 2>&1
echo "== tests rc=$? at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" $W/pytest_w4a16.log | tail -12
timeout 90 python3 -m benchmarks.cli engine decode-c1 --formats int4-all --budget-s 65 \
  --out $W/decode-c1-int4-all.json > $W/decode-c1.log 2>&1
echo "== decode-c1 int4-all rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning $W/decode-c1.log | tail -5
left=$(( 295 - ($(date +%s) - START) ))
if [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m lab.diagnostics.w4a16_decode_sweep --budget-s $(( left - 30 )) \
    --out $W/w4a16_decode.json > $W/w4a16_decode.log 2>&1
  echo "== sweep rc=$? at $(( $(date +%s) - START ))s"
  grep -E "^copy|^candidate|^old|^new|^tma|^prefetch|^swap|^peer|^->|budget|Error" $W/w4a16_decode.log | tail -24
  grep -E "=>" $W/w4a16_decode.log
else
  echo "== sweep skipped: ${left}s left"
fi
tar czf "$OUT/r6_w4a16.tgz" -C $W .
echo "== done at $(( $(date +%s) - START ))s"
