#!/usr/bin/env bash
# Session 19's H100 call (<= ~560 s): the draft policy's warm-up calibration (step costs timed at every
# load before serving; prompts joining a load priced to lose get no MTP layer) against the same code
# warmed without it (`--no-calibrate`), on one machine: the mtp bench (issue 28: c=1 and c=64, on / off)
# twice, then the plain-step diagnostic. Everything in $OUT/r19.tgz, packed after each stage.
#   run(command="timeout -s KILL 590 bash lab/device/r19.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r19 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r19.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-190}
WAVES=${WAVES:-1}
for variant in nocal cal; do
  flag=""; [ "$variant" = nocal ] && flag="--no-calibrate"
  fits $(( BUDGET + 50 )) "mtp bench $variant" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
    --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-2} --budget-s "$BUDGET" --c64-waves "$WAVES" $flag \
    --out $W/mtp-$variant.json > $W/mtp-$variant.log 2>&1
  echo "== mtp bench $variant rc=$? at $(el)s"; grep -v Warning $W/mtp-$variant.log | grep -E "speedup|c64|refused|Error|error" | head -12
  python3 -m lab.diagnostics.mtp_runs $W/mtp-$variant.json 2>&1 | head -40
  pack
done
fits 60 "plain step" && timeout 80 python3 -m lab.diagnostics.plain_step_gpu --rounds 3 > $W/plain-step.log 2>&1
echo "== plain step rc=$? at $(el)s"; tail -12 $W/plain-step.log
pack
echo "== done at $(el)s"
