#!/usr/bin/env bash
# Session 27's first H100 call (issue 28, <= ~560 s): every launch of a plain and a greedy k=3 step by
# source line (lab/diagnostics/step_kernels.py, eager, and graphed device events), then
# spec_plain_gpu on GLM (replay times; session 26's call 4), then the calibrated mtp bench.
#   run(command="timeout -s KILL 590 bash lab/device/r27.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r27 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r27.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
BUDGET=${BUDGET:-150}
fits 150 "step_kernels" && timeout 150 python3 -m lab.diagnostics.step_kernels --models ${SK_MODELS:-glm,kimi} --k 3 \
  --steps 3 --top 60 --out $W/step_kernels.json > $W/step_kernels.log 2>&1
echo "== step_kernels rc=$? at $(el)s"; grep -vE "Warning|profiler|USDT|^\[W" $W/step_kernels.log | head -120
pack
if [ -z "${SKIP_DIAG:-}" ]; then
  fits 130 "spec_plain_gpu glm" && timeout 130 python3 -m lab.diagnostics.spec_plain_gpu --models glm \
    --seqs 1,64 --steps 100 --rounds 3 --out $W/spec_plain_gpu-glm.json > $W/spec_plain_gpu-glm.log 2>&1
  echo "== spec_plain_gpu rc=$? at $(el)s"; grep -v Warning $W/spec_plain_gpu-glm.log | grep -E "^==|^   " | head -40
  pack
fi
if [ -n "${FULL_PROJECTION:-}" ]; then  # GLM 5.2 at the full depth of rank 0 of 8 (INT4 experts ~55 GB)
  fits 300 "full-depth projection" && timeout 300 python3 -m benchmarks.cli engine mtp --models "" \
    --depths full --rank-of 8 --out $W/mtp-full.json > $W/mtp-full.log 2>&1
  echo "== full-depth projection rc=$? at $(el)s"; grep -v Warning $W/mtp-full.log | tail -8
  pack
fi
[ -z "${SKIP_BENCH:-}" ] && fits $(( BUDGET + 80 )) "mtp bench" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds 3 --budget-s "$BUDGET" --c64-waves 3 \
  --out $W/mtp-cal.json > $W/mtp-cal.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-cal.log | grep -E "speedup|c64|refused|Error|error" | head -12
pack
echo "== done at $(el)s"
