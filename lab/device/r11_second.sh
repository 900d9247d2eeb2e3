#!/usr/bin/env bash
# The measurement call after session 11's merges, one H200, <= ~560 s (run r11_first.sh's GPU tests
# first, or keep its test stage here: TESTS=1):
# 0. (TESTS=1) the speculative GPU tests of r11_first.sh;
# 1. `kumo bench engine mtp` (BUDGET s, 4 rounds at c=64): speedup_c1 since the reasoning guards run
#    inside the greedy device graph (8772c41; the r10 figure, 0.89x GLM, predates it) and c=64 on/off
#    with the MTP KV catch-up (a8bc3eb);
# 2. lab/diagnostics/c64_idle_spec.py on CUDA: launches a idle step with speculation on vs off, the
#    catch-up step's wall against a plain step;
# 3. the speculative step profiles (lab/diagnostics/spec_profile.py), GLM and Kimi nano.
# Everything in $OUT/r11_second.tgz (packed after each stage: a cut call keeps what came before).
#   run(command="bash lab/device/r11_second.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r11s && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r11_second.tgz" -C $W .; }
LIMIT=${LIMIT:-540}  # a stage starts only if its timeout ends before LIMIT s (the call's own limit less a margin)
if [ -n "${TESTS:-}" ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 150 -rfE \
    tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_verify_graphs.py \
    tests/backend/engine/test_speculative_sampled.py tests/backend/engine/test_speculative_catch_up.py \
    tests/backend/engine/test_speculative_idle.py > $W/pytest.log 2>&1
  echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E " $W/pytest.log | tail -8
  pack
fi
BUDGET=${BUDGET:-200}
timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp --models models/glm-5.2-nano,models/kimi-k2.6-nano \
  --c64-rounds ${C64_ROUNDS:-4} --budget-s "$BUDGET" ${MTP_ARGS:-} --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|step_ms|acceptance|first_drafting" | head -30
pack
fits 100 c64_idle_spec && timeout 100 python3 -m lab.diagnostics.c64_idle_spec --device cuda --max-tokens 128 --rounds 4 --resume 32 --top 0 \
  > $W/c64_idle_spec.log 2>&1
echo "== c64 idle rc=$? at $(el)s"; tail -20 $W/c64_idle_spec.log 2>/dev/null
pack
for m in glm-5.2-nano kimi-k2.6-nano; do
  fits 100 "profile $m" || break
  timeout 100 python3 -m lab.diagnostics.spec_profile --model models/$m --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(el)s"; grep -A14 "== side" $W/spec_profile-$m.txt | grep -v "^---" | head -30
  pack
done
echo "== done at $(el)s"
