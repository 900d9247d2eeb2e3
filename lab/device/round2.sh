#!/usr/bin/env bash
# Round 2's device calls (2026-12-04), one stage a call, each inside the 10-minute limit; carry [".whl"]
# (the cp312 wheels listed in lab/device/device_plan.sh's header, llguidance 1.9.1 among them).
#   run(command="bash lab/device/round2.sh checks", carry=[".whl"])   # ~8 min: every gpu-marked test, the
#       unmarked kernel tests on CUDA, the review checks — the restructure's "gpu tests pass on the H200"
#   run(command="bash lab/device/round2.sh decode", carry=[".whl"])   # ~8 min: the c=1 decode-step record
# Logs land in $OUT (8 files come back at most); the last lines printed are the summary.
set -uo pipefail
stage=${1:?checks|decode|scenario|audit}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
summary() { for f in "$@"; do echo "== $f"; grep -E "passed|failed|FAILED|^ERROR| FAIL |Timeout" "$OUT/$f" | tail -25; done; }
case $stage in
  checks)
    # -p no:benchmark: the image's pytest-benchmark warns under xdist (an INTERNALERROR with filterwarnings=error)
    timeout 500 python3 -m pytest -m gpu -n 6 -p no:cacheprovider -p no:benchmark --tb=short --timeout 300 -rfE \
      tests/kernels tests/backend > "$OUT/pytest_gpu.log" 2>&1 &
    timeout 300 python3 -m pytest -m "not gpu" -n 8 -p no:cacheprovider -p no:benchmark --tb=short --timeout 120 \
      -rfE tests/kernels > "$OUT/pytest_kernels_on_cuda.log" 2>&1
    timeout 150 python3 -m lab.diagnostics.gpu_review_checks > "$OUT/review_checks.log" 2>&1
    wait
    summary pytest_gpu.log pytest_kernels_on_cuda.log review_checks.log
    ;;
  decode)  # FORMATS (default int4,int4-all), BUDGET (s, default 400); GPU_TESTS=1: the decode kernels'
    # gpu tests first (never beside the timed record)
    if [ "${GPU_TESTS:-0}" = 1 ]; then
      timeout 200 python3 -m pytest -m gpu -n 4 -p no:cacheprovider -p no:benchmark --tb=short --timeout 150 -rfE \
        tests/backend/quant/test_quant_decode_cuda.py tests/kernels/test_fp8_gemm.py tests/kernels/test_int4_linear.py \
        tests/kernels/test_w4a8_gemm.py tests/kernels/test_w4a16_gemm.py tests/backend/server/test_server_architectures.py \
        tests/backend/server/test_serving.py tests/backend/tools/test_random_checkpoint.py \
        tests/backend/engine/test_decode_steps.py tests/backend/server/test_warmup.py > "$OUT/pytest_gpu_decode.log" 2>&1
      summary pytest_gpu_decode.log
    fi
    tag=$(echo "${FORMATS:-int4,int4-all}" | tr ',' '_')
    timeout $(( ${BUDGET:-400} + 120 )) python3 -m benchmarks.cli engine decode-c1 --formats "${FORMATS:-int4,int4-all}" \
      --budget-s "${BUDGET:-400}" --out "$OUT/decode-c1-$tag.json" > "$OUT/decode-c1-$tag.log" 2>&1
    grep -v Warning "$OUT/decode-c1-$tag.log" | tail -30
    ;;
  audit)  # the GPU tag-check audit's tests and the gpu tests that failed before their fixes
    timeout 400 python3 -m pytest -m gpu -n 6 -p no:cacheprovider -p no:benchmark --tb=short --timeout 300 -rfE \
      tests/kernels/test_paged_decode_gqa.py tests/kernels/test_paged_prefill_gqa.py \
      tests/kernels/test_dsa_indexer_triton.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py \
      tests/kernels/test_kv_write_triton.py tests/backend/engine/test_decode_graphs_cuda.py \
      tests/backend/engine/test_speculative_cuda.py tests/benchmarks/test_rank_of.py \
      tests/backend/server/test_warmup.py > "$OUT/pytest_gpu_audit.log" 2>&1
    summary pytest_gpu_audit.log
    ;;
  scenario)  # SCENARIO, SARGS (its options), STIME (s, default 400); GPU_TESTS=1: the merged features'
    # gpu tests first (speculative decoding, --rank-of, warm-up, decode steps, quantized decode)
    if [ "${GPU_TESTS:-0}" = 1 ]; then
      timeout 240 python3 -m pytest -m gpu -n 4 -p no:cacheprovider -p no:benchmark --tb=short --timeout 200 -rfE \
        tests/backend/engine/test_speculative_cuda.py tests/benchmarks/test_rank_of.py \
        tests/backend/server/test_warmup.py tests/backend/engine/test_decode_steps.py \
        tests/backend/quant/test_quant_decode_cuda.py tests/backend/engine/test_ranks_engine.py \
        > "$OUT/pytest_gpu_merged.log" 2>&1
      summary pytest_gpu_merged.log
    fi
    timeout "${STIME:-400}" python3 -m benchmarks.cli engine scenario "$SCENARIO" $SARGS \
      --out "$OUT/$SCENARIO.json" > "$OUT/$SCENARIO.log" 2>&1
    echo "rc=$?"; grep -v Warning "$OUT/$SCENARIO.log" | tail -30
    ;;
esac
