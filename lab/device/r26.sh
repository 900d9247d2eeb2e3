#!/usr/bin/env bash
# Session 26's first H100 call (issue 28, <= ~450 s): where a speculative engine's plain decode step
# loses 26-34 µs to speculation off (lab/diagnostics/spec_plain_gpu.py: A as served but priced to lose,
# Z = A with the decoder's hooks cut out, B = off; GLM and Kimi nano at c = 1 and c = 64; since, O, T and Y:
# the docstring).
#   run(command="timeout -s KILL 590 bash lab/device/r26.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r26 && rm -rf $W && mkdir -p $W
LIMIT=${LIMIT:-560}
for m in ${MODELS:-glm kimi}; do
  fits 240 "spec_plain_gpu $m" && timeout 240 python3 -m lab.diagnostics.spec_plain_gpu --models $m \
    --seqs ${SEQS:-1,64} --steps ${STEPS:-60} --rounds ${ROUNDS:-3} --out $W/spec_plain_gpu-$m.json \
    > $W/spec_plain_gpu-$m.log 2>&1
  echo "== $m rc=$? at $(el)s"; grep -v Warning $W/spec_plain_gpu-$m.log | grep -E "^==|^   "
  tar czf "$OUT/r26.tgz" -C $W .
done
echo "== done at $(el)s"
