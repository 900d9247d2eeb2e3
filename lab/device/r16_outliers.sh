#!/usr/bin/env bash
# Session 16's second call (one H100, a cold start: ~200-300 s of command time left in the budget):
# 1. lab.diagnostics.spec_outliers on GLM nano (issue 28): what runs inside the adaptive runs' slow
#    steps (Triton compiles, CUDA graph captures, collections), 4 runs of chat + tool-call prompts;
# 2. the mtp bench's c = 64 part for GLM nano (cut by the budget in call 4): the catch-up gate and
#    the burst's admission (no drafts while requests wait), 3 A/B/B/A rounds.
#   run(command="timeout -s KILL 590 bash lab/device/r16_outliers.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r16b && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r16b.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
timeout 150 python3 -m lab.diagnostics.spec_outliers --model models/glm-5.2-nano --runs 4 > $W/outliers.log 2>&1
echo "== spec_outliers rc=$? at $(el)s"; grep -v -i warn $W/outliers.log | head -60
pack
fits 150 "GLM c64" && timeout 150 python3 -m benchmarks.cli engine mtp --models models/glm-5.2-nano \
  --tasks tool-call --prompts 2 --rounds 1 --c64-rounds 3 --rank-of 0 --budget-s 110 \
  --out $W/mtp-c64.json > $W/mtp-c64.log 2>&1
echo "== GLM c64 rc=$? at $(el)s"; grep -E "speedup|c64" $W/mtp-c64.log | head -4
python3 -m lab.diagnostics.mtp_runs $W/mtp-c64.json 2>&1 | tail -14
pack
echo "== done at $(el)s"
