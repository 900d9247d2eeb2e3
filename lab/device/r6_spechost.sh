#!/usr/bin/env bash
# Issue 28, the greedy speculative step's host work (r6-spechost) on one H200 (~7 min; carry [".whl"]):
#   run(command="bash lab/device/r6_spechost.sh", carry=[".whl"], kind="nvidia-h200")
# 1. the speculative and decode-graph gpu tests (the greedy step's staging into the runner's buffer);
# 2. a profile of the steps, nano GLM and Kimi (lab/diagnostics/spec_profile.py: ms per phase, copies
#    and reads per step; side F is the greedy step);
# 3. the speculative record (`kumo bench engine mtp`, BUDGET s): fixed_k_run step_ms_mean against
#    2026-12-04-mtp-gpu.json (3.39 ms GLM chat), and speedup_c1.
# Everything lands in $OUT/r6_spechost.tgz, summaries printed.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r6sh && rm -rf $W && mkdir -p $W
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 230 -rfE \
  tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_decode_graphs_cuda.py > $W/spec_gpu.log 2>&1
echo "== spec gpu tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/spec_gpu.log | tail -15
for m in glm-5.2-nano kimi-k2.6-nano; do
  timeout 150 python3 -m lab.diagnostics.spec_profile --model models/$m --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(( $(date +%s) - START ))s"; grep -A16 "== side" $W/spec_profile-$m.txt | grep -v "^---" | head -60
done
timeout $(( ${BUDGET:-200} + 90 )) python3 -m benchmarks.cli engine mtp --budget-s "${BUDGET:-200}" --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning $W/mtp-gpu.log | tail -45
tar czf "$OUT/r6_spechost.tgz" -C $W .
