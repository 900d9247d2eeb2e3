#!/usr/bin/env bash
# Session 12's speculative-step call (issue 28), one H100 or H200, <= ~420 s, after r12-specstep's merge
# (the greedy step's graph cut from ~515 to ~340 estimated launches for GLM nano at k = 3: narrow DSA
# graphs for the verify, whole-step, depth-0 and draft graphs, one Step shared by the verify and
# depth 0, the chained depths' positions/slots/tags/cos-sin at once, the MoE's shift and mask
# skipped when every expert is local, Step's page tags from positions; lab/results/2026-12-05-r12-specstep/):
# 1. the GPU tests of the speculative files and of the paths the change touched (the model on CUDA,
#    decode graphs' narrow widths);
# 2. `kumo bench engine mtp` (BUDGET s): speedup_c1 (was 0.95x/0.94x, the adaptive policy drafting
#    nothing: the fixed-k run's greedy step 2.41 ms against 0.80 plain), c=64 on/off, and the GLM 5.2
#    projection, now warmed per (depth, k), a median over 3 runs' steady steps, refused (with its
#    reasons, in the record) when a step ran eagerly or the times are not monotonic;
# 3. the speculative step profiles (lab/diagnostics/spec_profile.py), GLM then Kimi nano: side F's
#    device events per step (736 GLM / 559 Kimi before) and kernel ms per step (1.385 / 0.949).
# Everything in $OUT/r12_spec.tgz (packed after each stage: a cut call keeps what came before).
#   run(command="bash lab/device/r12_spec.sh", carry=[".whl"], timeout_s=600)
# (no .whl/ in a fresh checkout: `bash lab/device/wheels.sh` first). Then copy the tarball's
# mtp-gpu.json to benchmarks/results/<date>-mtp-gpu.json and the profiles to lab/results/.
source "$(dirname "$0")/preamble.sh"
W=/tmp/r12s && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r12_spec.tgz" -C $W .; }
LIMIT=${LIMIT:-430}  # a stage starts only if its timeout ends before LIMIT s
timeout 170 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 120 -rfE \
  tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_decode_graphs_cuda.py \
  tests/backend/models/test_models_cuda.py tests/backend/engine/test_verify_graphs.py \
  tests/backend/engine/test_speculative_sampled.py tests/backend/engine/test_speculative_host.py > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E " $W/pytest.log | tail -10
pack
BUDGET=${BUDGET:-120}
fits $(( BUDGET + 80 )) "mtp bench" && timeout $(( BUDGET + 80 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-2} --budget-s "$BUDGET" ${MTP_ARGS:-} \
  --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|refused|step_ms|acceptance|eagerly" | head -30
pack
for m in glm-5.2-nano kimi-k2.6-nano; do
  fits 90 "profile $m" || break
  timeout 90 python3 -m lab.diagnostics.spec_profile --model models/$m --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(el)s"; grep -A14 "== side" $W/spec_profile-$m.txt | grep -v "^---" | head -36
  pack
done
echo "== done at $(el)s"
