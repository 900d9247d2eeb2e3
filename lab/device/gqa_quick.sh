#!/usr/bin/env bash
# One device call of at most 150 s (timeouts 30 + 35 + 30 + 30 + 22 s): GQA decode, GQA prefill and the
# DSA indexer, every tile-table entry, with interleaved A/B tag-check rows (the benchmarks' --quick),
# then the gpu tests of the three kernels. Compiles run first, in parallel (warm_gqa). JSON and logs go
# to $OUT; each benchmark writes its record after every case, so a timeout keeps what ran.
# Usage (device tool, `.whl` carried for pytest-asyncio): bash lab/device/gqa_quick.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 30 python3 -m benchmarks.kernels.warm_gqa --jobs 14 > "$OUT/warm.log" 2>&1; tail -1 "$OUT/warm.log"
for step in "paged_decode 35" "paged_prefill 30" "dsa_indexer 30"; do
  set -- $step
  timeout "$2" python3 -m "benchmarks.kernels.bench_$1" --quick --out "$OUT/$1.json" 2>&1 \
    | grep -v Warning > "$OUT/bench_$1.log"; echo "== bench_$1"; cat "$OUT/bench_$1.log"
done
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest_asyncio*.whl
PYTHONPATH=/tmp/site:$PWD timeout 22 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels/test_paged_decode_gqa.py tests/kernels/test_paged_prefill_gqa.py tests/kernels/test_dsa_indexer_triton.py \
  2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
