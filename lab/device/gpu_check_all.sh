#!/usr/bin/env bash
# One device call: every gpu-marked test under tests/kernels and tests/backend (no -x: every failure is
# listed), then the benchmarks named in BENCHES (unset: "w4a16"; empty: none), each under its own timeout; logs to $OUT.
# Usage (through the device tool, `.whl` with msgspec, pytest-asyncio, llguidance and transformers 5.24
# carried): bash lab/device/gpu_check_all.sh
#   TEST_TIMEOUT (default 330 s) bounds the tests, BENCH_TIMEOUT (default 150 s) each benchmark.
set -u
rm -rf /tmp/site  # a warm machine keeps /tmp: never mix wheels of two calls
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 240 -rfE \
  tests/kernels tests/backend 2>&1 | tee "$OUT/pytest_gpu_all.log" | grep -vE "^(\.|s|F|E)+ *\[" | tail -40
for bench in ${BENCHES-w4a16}; do
  timeout "${BENCH_TIMEOUT:-150}" python3 -m "benchmarks.kernels.bench_$bench" --out "$OUT/$bench.json" 2>&1 \
    | grep -v Warning > "$OUT/bench_$bench.log"; echo "== bench_$bench rc=$?"; tail -30 "$OUT/bench_$bench.log"
done
