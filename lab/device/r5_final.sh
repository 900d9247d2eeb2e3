#!/usr/bin/env bash
# nvidia-h200-x2, one call (~8 min; carry [".whl"]):
#   run(command="bash lab/device/r5_final.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. both GPUs, NCCL, stopping at the first failure (-x: its traceback comes back): TP2 decode graphs
#    against eager, TP2 speculative against plain, `kumo backend --tp 2` on two GPUs against one;
# 2. side by side: GPU 0 issue 24's MLA slice re-fit (gpu tests, then the batch-1 sweep: lab/device/
#    mla_splits.sh's first two stages); GPU 1 the decode-c1 record in the four quantized formats.
# Everything in $OUT/r5_final.tgz.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r5f && rm -rf $W && mkdir -p $W
timeout 200 python3 -m pytest -x -p no:cacheprovider -p no:benchmark --tb=short --timeout 150 -rfE -s \
  tests/backend/engine/test_ranks_cuda.py "tests/backend/server/test_ranks_server.py::test_two_gpus_answer_what_one_answers" \
  > $W/nccl.log 2>&1
echo "== nccl rc=$? at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |tp=2|Timeout|Error" $W/nccl.log | grep -v UserWarning | tail -30
( export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 -m pytest -n 8 -p no:cacheprovider -p no:benchmark --tb=line --timeout 150 -rfE -m gpu \
    tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py tests/backend/engine/test_decode_graphs_cuda.py \
    tests/backend/models/test_models_cuda.py > $W/pytest_mla.log 2>&1
  timeout 170 python3 -m lab.diagnostics.mla_c1_splits --out $W/mla_c1_splits.json > $W/mla_c1_splits.log 2>&1 ) &
mla=$!
( CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m benchmarks.cli engine decode-c1 --formats int4,int4-all,fp8,fp8-all \
    --budget-s 250 --out $W/decode-c1.json > $W/decode-c1.log 2>&1 ) &
c1=$!
wait $mla; echo "== mla at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" $W/pytest_mla.log | tail -8
grep -E "^ctx|rel. err" $W/mla_c1_splits.log
wait $c1; echo "== decode-c1 at $(( $(date +%s) - START ))s"; grep -v Warning $W/decode-c1.log | tail -9
tar czf "$OUT/r5_final.tgz" -C $W .
