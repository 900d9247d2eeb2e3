#!/usr/bin/env bash
# Which merged GPU test fails first, each file in its own process (a device-side assert poisons the
# process it fires in, and under xdist every later test of that worker):
#   run(command="bash lab/device/round3_diag.sh", carry=[".whl"])   # ~2.5 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_LAUNCH_BLOCKING=1
i=0
for f in tests/kernels/test_fused_moe.py tests/backend/engine/test_speculative_cuda.py \
         tests/backend/engine/test_decode_graphs_cuda.py tests/benchmarks/test_rank_of.py \
         tests/backend/server/test_warmup.py tests/backend/models/test_models_cuda.py; do
  i=$((i + 1))
  timeout 170 python3 -m pytest -x -p no:cacheprovider -p no:benchmark -p no:xdist --tb=long -q --timeout 160 \
    -k "not cpu" "$f" > "$OUT/diag$i.log" 2>&1 &
done
wait
for j in $(seq 1 $i); do echo "== diag$j"; grep -E "passed|failed|^E |\.py:[0-9]+: " "$OUT/diag$j.log" | head -14; done
