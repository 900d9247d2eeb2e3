#!/usr/bin/env bash
# One call: the nano retrain (lab/device/round3_train.sh, six files back) and, beside it at low priority,
# correctness-only GPU checks of what merged this session (the trainings use a few % of the GPU; nothing
# here is timed): the rank-of decode-graph tests, the warm-up compile test and its diagnostic.
#   run(command="bash lab/device/round3_train_and_tests.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
(
  sleep 20  # after round3_train.sh installed its wheels
  rm -rf /tmp/site2 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
  export PYTHONPATH=/tmp/site2:$PWD
  {
    TRITON_CACHE_DIR=/tmp/tc-warm2 nice -n 19 timeout 200 python3 -m lab.diagnostics.warmup_new_kernels 2>&1 | grep -v Warn | tail -8
    nice -n 19 timeout 300 python3 -m pytest -m gpu -n 2 -p no:cacheprovider -p no:benchmark --tb=short --timeout 240 -rfE \
      tests/benchmarks/test_rank_of.py tests/backend/server/test_warmup.py tests/backend/engine/test_decode_graphs_cuda.py 2>&1 | tail -30
  } > "$OUT/gpu_checks.log" 2>&1
) &
bash lab/device/round3_train.sh
rc=$?
wait
echo "== gpu checks"; grep -E "passed|failed|FAILED|^ERROR|NEW|warm-up compiled" "$OUT/gpu_checks.log" | tail -15
exit $rc
