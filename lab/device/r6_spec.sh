#!/usr/bin/env bash
# Issue 28, round 6: whole greedy speculative steps in one graph, the rate gate's bounded probes
# (~8 min on nvidia-h200-x2; carry [".whl"]):
#   run(command="bash lab/device/r6_spec.sh", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
# 1. both GPUs, NCCL: speculative TP2 against plain TP2 (host path and greedy-step graphs);
# 2. side by side: GPU 0 the speculative record (`kumo bench engine mtp`, BUDGET s), GPU 1 a
#    profile of the speculative step (plain, greedy-step, host path: lab/diagnostics/spec_profile.py),
#    then the speculative gpu tests.
# Everything lands in $OUT/r6_spec.tgz, summaries printed.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r6 && rm -rf $W && mkdir -p $W
timeout 180 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 170 -rfE -s \
  "tests/backend/engine/test_ranks_cuda.py::test_nccl_speculative_equals_plain" > $W/nccl.log 2>&1
echo "== nccl at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/nccl.log | tail -15
( CUDA_VISIBLE_DEVICES=0 timeout $(( ${BUDGET:-300} + 60 )) python3 -m benchmarks.cli engine mtp --budget-s "${BUDGET:-300}" \
    --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1 ) &
bench=$!
( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m lab.diagnostics.spec_profile --out $W/spec_profile.txt > $W/spec_profile.log 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 190 -rfE \
    tests/backend/engine/test_speculative_cuda.py > $W/spec_gpu.log 2>&1 ) &
tests=$!
wait $tests; grep -A24 "== side" $W/spec_profile.txt | grep -E "==|^   [a-z]" | head -70
echo "== spec gpu tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/spec_gpu.log | tail -15
wait $bench; echo "== mtp bench rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning $W/mtp-gpu.log | tail -45
tar czf "$OUT/r6_spec.tgz" -C $W .
