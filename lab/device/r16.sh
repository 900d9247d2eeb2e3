#!/usr/bin/env bash
# Session 16's validation call (one H100 or H200, <= ~560 s), for what session 16 changed:
# 1. the mtp bench (issue 28): the backend's start-up heap frozen out of full collections
#    (backend/engine/heap.py; session 15/16 A runs had 0.15-0.5 s outliers: each run now records its
#    collections, `gc`), and the catch-up gate (a load drafting wins does not start drafting when the
#    catch-up costs more than drafting can still save: c=64 ran 0.78x in session 16's first call);
# 2. integrity_overhead at rank-of-8 (issue 25): its every-eighth-run slow A (0.15-0.2 s) with the
#    collections recorded per run, under the frozen heap;
# 3. the speculative CUDA tests (the decoder's catch-up gate on the GPU path).
# Everything in $OUT/r16.tgz, packed after each stage.
#   run(command="timeout -s KILL 590 bash lab/device/r16.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r16 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r16.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-120}
timeout $(( BUDGET + 90 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-2} --budget-s "$BUDGET" \
  --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|refused|projected" | head -20
python3 -m lab.diagnostics.mtp_runs $W/mtp-gpu.json 2>&1 | head -40
pack
fits 220 "integrity_overhead" && timeout 220 python3 -m benchmarks.cli engine scenario integrity_overhead \
  --rank-of 8 --layers 8 --rounds 6 --budget-s 190 --out $W/integrity.json > $W/integrity.log 2>&1
echo "== integrity_overhead rc=$? at $(el)s"; grep -v -i warn $W/integrity.log | grep -E "integrity|%" | head -6
python3 -m lab.diagnostics.mtp_runs --scenario $W/integrity.json 2>&1 | head -30
pack
fits 150 "speculative CUDA tests" && timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/backend/engine/test_speculative_cuda.py > $W/pytest.log 2>&1
echo "== speculative CUDA tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|Fatal" $W/pytest.log | tail -8
pack
echo "== done at $(el)s"
