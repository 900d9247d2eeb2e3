#!/usr/bin/env bash
# Session 26's second H100 call (issue 28, <= ~560 s), after the plain stream's hold (PLAIN_REASK):
# lab/diagnostics/spec_plain_gpu.py again (A vs Z vs B, GLM and Kimi nano, c = 1 and 64), then the mtp
# bench calibrated as served (3 c=64 rounds, steps timed by kind), then `lab.diagnostics.mtp_runs`.
#   run(command="timeout -s KILL 590 bash lab/device/r26b.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r26b && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r26b.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-170}
for m in glm kimi; do
  fits 150 "spec_plain_gpu $m" && timeout 150 python3 -m lab.diagnostics.spec_plain_gpu --models $m \
    --seqs 1,64 --steps 100 --rounds 3 --out $W/spec_plain_gpu-$m.json > $W/spec_plain_gpu-$m.log 2>&1
  echo "== $m rc=$? at $(el)s"; grep -v Warning $W/spec_plain_gpu-$m.log | grep -E "^==|^   "
  pack
done
fits $(( BUDGET + 80 )) "mtp bench" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds 3 --budget-s "$BUDGET" --c64-waves 3 \
  --out $W/mtp-cal.json > $W/mtp-cal.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-cal.log | grep -E "speedup|c64|refused|Error|error" | head -12
python3 -m lab.diagnostics.mtp_runs $W/mtp-cal.json 2>&1 | head -60
pack
echo "== done at $(el)s"
