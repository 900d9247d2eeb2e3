#!/usr/bin/env bash
# Session 27's call after the launch cuts (issue 28): the CUDA tests of what changed (query tiles in
# one launch and made once a step, the cos/sin table, the MTP input norms), then step_kernels on GLM and
# the calibrated mtp bench (r27.sh).
#   run(command="timeout -s KILL 590 bash lab/device/r27b.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r27 && rm -rf $W && mkdir -p $W
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_mla_prefill.py tests/kernels/test_paged_prefill_gqa.py tests/kernels/test_dsa_indexer_triton.py \
  tests/backend/engine/test_speculative_cuda.py tests/backend/models/test_models_cuda.py > $W/pytest.log 2>&1
echo "== tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" $W/pytest.log | tail -25
tar czf "$OUT/r27b.tgz" -C $W .
export SK_MODELS=glm SKIP_DIAG=1 BUDGET=${BUDGET:-150} LIMIT=$(( ${TOTAL:-400} - $(el) ))
bash "$(dirname "$0")/r27.sh" 2>&1 | grep -vE "^NVIDIA" 
