#!/usr/bin/env bash
# Issue 28 on nvidia-h200-x2 after the draft chain moved onto the device (~8 min; carry [".whl"]):
#   run(command="bash lab/device/r5_spec.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. both GPUs, NCCL: decode graphs TP2 against eager, speculative TP2 against plain TP2, and
#    `kumo backend --tp 2` on cuda:0 + cuda:1 against one GPU;
# 2. side by side: GPU 0 the speculative record (`kumo bench engine mtp`, BUDGET s), GPU 1 a
#    profile of the speculative step (lab/diagnostics/spec_profile.py), then the speculative and
#    decode-graph gpu tests.
# Everything lands in $OUT/r5_spec.tgz (one file: a call brings back only a few), summaries printed.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r5 && rm -rf $W && mkdir -p $W
timeout 300 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 280 -rfE -s \
  tests/backend/engine/test_ranks_cuda.py "tests/backend/server/test_ranks_server.py::test_two_gpus_answer_what_one_answers" \
  > $W/nccl.log 2>&1
echo "== nccl at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |tp=2|Timeout" $W/nccl.log | tail -25
( CUDA_VISIBLE_DEVICES=0 timeout $(( ${BUDGET:-300} + 90 )) python3 -m benchmarks.cli engine mtp --budget-s "${BUDGET:-300}" \
    --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1 ) &
bench=$!
( CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m lab.diagnostics.spec_profile --out $W/spec_profile.txt > $W/spec_profile.log 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 280 -rfE \
    tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_decode_graphs_cuda.py > $W/spec_gpu.log 2>&1 ) &
tests=$!
wait $tests; grep -A14 "== side" $W/spec_profile.txt | grep -v "^---" | head -60; echo "== spec gpu tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/spec_gpu.log | tail -15
wait $bench; echo "== mtp bench rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning $W/mtp-gpu.log | tail -45
tar czf "$OUT/r5_spec.tgz" -C $W .
