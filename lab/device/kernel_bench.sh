#!/usr/bin/env bash
# One device call: GPU tests of the kernels, then the benchmarks; logs and JSON go to $OUT.
# Usage (through the device tool, with .whl carried): bash lab/device/kernel_bench.sh
# Options: BENCHES picks benchmarks (default "paged_decode w4a16"; also mla_decode, fused_moe,
#   paged_prefill (GQA prefill, GLM-4.5-Air), dsa_indexer (GLM-5's indexer) and w4a8 (INT4 prefill on
#   FP8 tensor cores, ~3-5 min: run it alone), e.g.
#   BENCHES=fused_moe BENCH_TIMEOUT=480 bash lab/device/kernel_bench.sh
# fused_moe needs ~75 GB of device memory (INT4, bf16, tinygemm and FP8 copies of 384 Kimi experts) and
# compiles ~20 tile variants on first use; its GPU tests: tests/kernels/test_fused_moe.py and
# tests/kernels/test_fused_moe_fp8.py -m gpu.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
timeout 240 python3 -m pytest tests/kernels/test_w4a16_gemm.py tests/kernels/test_w4a8_gemm.py tests/kernels/test_paged_decode_gqa.py \
  tests/kernels/test_paged_prefill_gqa.py tests/kernels/test_dsa_indexer_triton.py -q -m gpu \
  -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
for bench in ${BENCHES:-paged_decode w4a16}; do
  timeout "${BENCH_TIMEOUT:-240}" python3 -m "benchmarks.kernels.bench_$bench" --out "$OUT/$bench.json" 2>&1 \
    | grep -v Warning | tee "$OUT/bench_$bench.log"
done
