#!/usr/bin/env bash
# One device call: every gpu-marked kernel and CUDA-engine test, then the W4A16 benchmark; logs to $OUT.
# Usage (through the device tool, `.whl` with msgspec + pytest-asyncio carried): bash benchmarks/kernels/gpu_check_all.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -x --timeout 240 \
  tests/kernels/test_fused_moe.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py \
  tests/kernels/test_kv_write_triton.py tests/kernels/test_w4a16_gemm.py tests/kernels/test_w4a8_gemm.py tests/kernels/test_paged_decode_gqa.py \
  tests/kernels/test_paged_prefill_gqa.py tests/kernels/test_dsa_indexer_triton.py tests/backend/test_models_cuda.py \
  tests/backend/test_engine.py 2>&1 | tee "$OUT/pytest_gpu_all.log" | tail -25
timeout "${BENCH_TIMEOUT:-150}" python3 -m benchmarks.kernels.bench_w4a16 --out "$OUT/w4a16.json" 2>&1 \
  | grep -v Warning | tee "$OUT/bench_w4a16.log" | tail -25
