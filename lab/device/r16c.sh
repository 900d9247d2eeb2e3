#!/usr/bin/env bash
# Session 16's third call (one H100; what the budget leaves after a cold start):
# 1. lab.diagnostics.spec_outliers on GLM nano, 3 runs: the merge kernel now compiles once for every
#    slice count (call 6: 230-260 ms compiles inside runs 0 and 1); what still compiles inside runs;
# 2. the mtp bench for GLM nano (c = 1 chat and tool calls, 3 rounds; c = 64, 3 rounds): the catch-up
#    gate's cost-model prior (call 6: the burst's last 2-4 sequences drafted and finished before a
#    verify, 0.58-0.66x in 2 of 3 rounds);
# 3. the MLA decode GPU tests (the merge kernel's change).
#   run(command="timeout -s KILL 590 bash lab/device/r16c.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r16c && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r16c.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
timeout 170 python3 -m lab.diagnostics.spec_outliers --model models/glm-5.2-nano --runs 3 > $W/outliers.log 2>&1
echo "== spec_outliers rc=$? at $(el)s"; grep -v -i warn $W/outliers.log | grep -E "^== |triton|capture" | head -30
pack
fits 200 "GLM mtp" && timeout 200 python3 -m benchmarks.cli engine mtp --models models/glm-5.2-nano \
  --rounds 3 --c64-rounds 3 --rank-of 0 --budget-s 150 --out $W/mtp-glm.json > $W/mtp-glm.log 2>&1
echo "== GLM mtp rc=$? at $(el)s"; grep -E "^glm|speedup|c64" $W/mtp-glm.log | head -3
python3 -m lab.diagnostics.mtp_runs $W/mtp-glm.json 2>&1 | grep -E "ratios|c64" | head -6
pack
fits 120 "MLA decode tests" && timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_mla_decode.py > $W/pytest.log 2>&1
echo "== MLA decode tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR" $W/pytest.log | tail -6
pack
echo "== done at $(el)s"
