#!/usr/bin/env bash
# Session 14's unmeasured work in ONE call (one H100 or H200, <= ~560 s; a fresh machine's start cost
# ~390 s of held time in session 14, so one call beats three):
# 1. the mtp bench first (issue 28), the number that matters most: the draft policy's fixes (cold steps are
#    not rates; starved probes draft 4 steps in a row; a load's first catch-up priced before its probe)
#    with the retrained MTP layers: speedup_c1 per model and task (goal >= 1.3x; fixed-3 tool calls ran
#    1.33x / 1.22x with the old layers), c=64 on / off (Kimi 0.80x before), the GLM 5.2 projection at
#    8/16/24 layers with the new acceptance. Check the A runs' `drafting_steps` and `policy_draft_cost`;
# 2. the GPU tests not yet run on a GPU: the capture-without-gc test, the fixed other-ranks MoE test,
#    the speculative CUDA tests again (they aborted once in a gc during a capture);
# 3. `lab.diagnostics.gemv_floor` (issue 24): the rank-of-8 W4A16 GEMVs against stream / no-op / memcpy
#    floors in the same graphs;
# 4. the FP8-dot MLA diagnostics (r14-mlafix's variant tests: which of pipelining, two warpgroups,
#    slicing or short sequences breaks the 64-row tile; five kernel variants to compile: last).
# Everything in $OUT/r15.tgz, packed after each stage. Follow-ups: mtp-gpu.json to
# benchmarks/results/<date>-mtp-gpu.json, the README's speculative row, lab/results/<date>-r15/.
#   run(command="timeout -s KILL 580 bash lab/device/r15_validate.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r15 && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r15.tgz" -C $W .; }
LIMIT=${LIMIT:-560}  # a stage starts only if its timeout ends before LIMIT s
BUDGET=${BUDGET:-120}
timeout $(( BUDGET + 90 )) python3 -m benchmarks.cli engine mtp \
  --models models/glm-5.2-nano,models/kimi-k2.6-nano --c64-rounds ${C64_ROUNDS:-2} --budget-s "$BUDGET" \
  --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|refused|projected" | head -20
python3 -c "import json,sys; r=json.load(open(sys.argv[1]))
for m,v in r['models'].items():
  for t,x in v['speedup_c1'].items():
    a=[q for rd in x['rounds'] for q in rd['runs'] if q['side']=='A']
    print(m, t, 'A runs (m, drafting steps, probes):', [(round(q['policy_draft_cost'],3), q['drafting_steps'], q['policy_probes']) for q in a])
  a=[q for rd in v['throughput_c64']['rounds'] for q in rd['runs'] if q['side']=='A']
  print(m, 'c64 A runs:', [(round(q['policy_draft_cost'],3), q['drafting_steps'], q['steps'], q['policy_probes']) for q in a])" $W/mtp-gpu.json 2>&1 | head -12
pack
fits 200 "GPU tests" && timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/backend/engine/test_decode_graphs_cuda.py tests/kernels/test_fused_moe.py \
  tests/backend/engine/test_speculative_cuda.py > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|Fatal" $W/pytest.log | tail -8
pack
fits 100 "gemv_floor" && timeout 100 python3 -m lab.diagnostics.gemv_floor --out $W/gemv_floor.json > $W/gemv_floor.log 2>&1
echo "== gemv_floor rc=$? at $(el)s"; grep -v -i warn $W/gemv_floor.log | tail -9
pack
fits 150 "FP8-dot MLA diagnostics" && timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_mla_fp8_dot.py tests/kernels/test_mla_fp8_dot_64_rows.py > $W/mla_fp8_dot.log 2>&1
echo "== FP8-dot MLA rc=$? at $(el)s"; grep -E "passed|failed|FAILED" $W/mla_fp8_dot.log | tail -8
pack
echo "== done at $(el)s"
