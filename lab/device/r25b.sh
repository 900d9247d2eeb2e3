#!/usr/bin/env bash
# Session 25's second H100 call (issue 28, ~80 s): the spec step profiles with side A0 (speculation on,
# policy held at k = 0) beside B (off): whether a spec engine's plain step is ~30 us slower on the
# device (events, busy time) or on the host.
#   run(command="timeout -s KILL 300 bash lab/device/r25b.sh", carry=[".whl"], timeout_s=320)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r25b && rm -rf $W && mkdir -p $W
for m in glm-5.2-nano kimi-k2.6-nano; do
  timeout 100 python3 -m lab.diagnostics.spec_profile --model models/$m --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(el)s"; grep -A12 "== side [BA]" $W/spec_profile-$m.txt | grep -E "side|step |runner|drafting|kind|busy|events|reads|copies"
  tar czf "$OUT/r25b.tgz" -C $W .
done
