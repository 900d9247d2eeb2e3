#!/usr/bin/env bash
# Issue 24, the DSA selection's radix kernel (branch r9-select): the selection and DSA indexer tests on
# CUDA (the indexer's rows now go through the radix path), then `bench_selection` (radix vs keys +
# torch.topk, alternating pairs, ~30 s). With AB=1, also the c=1 decode profile with each path
# (`--select topk` forces the old one; compare sbtopk::gatherTopK's 0.366 ms of 3.58 ms a step).
#   run(command="bash lab/device/r9_select.sh", carry=[".whl"], timeout_s=300)         # ~2 min
#   run(command="AB=1 bash lab/device/r9_select.sh", carry=[".whl"], timeout_s=600)    # ~6-8 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_selection_triton.py \
  tests/kernels/test_dsa_indexer_triton.py > "$OUT/tests.log" 2>&1
tail -5 "$OUT/tests.log"
timeout 90 python3 -m benchmarks.kernels.bench_selection --out "$OUT/selection.json" 2>&1 | grep -v Warning \
  | tee "$OUT/bench_selection.log"
if [ "${AB:-0}" = 1 ]; then
  for select in radix topk; do
    timeout 180 python3 -m lab.diagnostics.decode_c1_profile --formats int4-all --graphs 1 --select $select \
      --out "$OUT/decode_c1_$select.json" > "$OUT/decode_c1_$select.log" 2>&1
    grep -v Warning "$OUT/decode_c1_$select.log" | grep -v "^USDT" | tail -25
  done
fi
