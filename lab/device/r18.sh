#!/usr/bin/env bash
# Session 18's call (one H100 or H200, <= ~560 s), for what session 18 changed:
# 1. the CUDA tests of the staging fix (host buffers in turn: chained draft depths once read each
#    other's inputs) and the speculative CUDA tests (every draft path over the new staging);
# 2. the mtp bench (issue 28) with per-request acceptance in the draft policy (chat runs first, then
#    tool calls, on one engine: session 18's first call had Kimi tool calls plain after chat, 0.93x)
#    and c=64 for both models (session 18's first call: GLM skipped for the budget, Kimi 0.785x).
# Everything in $OUT/r18.tgz, packed after each stage.
#   run(command="timeout -s KILL 590 bash lab/device/r18.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r18 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r18.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-230}
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/backend/engine/test_staging_cuda.py tests/backend/engine/test_speculative_cuda.py > $W/pytest.log 2>&1
echo "== CUDA tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|Fatal" $W/pytest.log | tail -8
pack
fits $(( BUDGET + 60 )) "mtp bench" && timeout $(( BUDGET + 90 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-2} --budget-s "$BUDGET" \
  --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|refused|projected" | head -20
python3 -m lab.diagnostics.mtp_runs $W/mtp-gpu.json 2>&1 | head -60
pack
echo "== done at $(el)s"
