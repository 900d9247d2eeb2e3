#!/usr/bin/env bash
# Session 25's H100 call (issue 28, <= ~400 s): the mtp bench calibrated (as served) with each run's
# steps timed by kind (decode / prompt / fill / drafting: where c=64's 3-5% loss with no drafting goes,
# and the spec side's prompt steps), then the spec step profile of GLM and Kimi nano chat.
#   run(command="timeout -s KILL 590 bash lab/device/r25.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r25 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r25.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-170}
fits $(( BUDGET + 60 )) "mtp bench" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds 3 --budget-s "$BUDGET" --c64-waves 3 \
  --out $W/mtp-cal.json > $W/mtp-cal.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-cal.log | grep -E "speedup|c64|refused|Error|error" | head -12
python3 -m lab.diagnostics.mtp_runs $W/mtp-cal.json 2>&1 | head -60
pack
for m in glm-5.2-nano kimi-k2.6-nano; do
  fits 100 "profile $m" && timeout 100 python3 -m lab.diagnostics.spec_profile --model models/$m \
    --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(el)s"; grep -A24 "== side" $W/spec_profile-$m.txt | grep -v "^---" | grep -v "^ *Name\|^$" | head -50
  pack
done
echo "== done at $(el)s"
