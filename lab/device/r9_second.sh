#!/usr/bin/env bash
# Session 9's second call, one H200, ≤ ~560 s (the speculative and decode-graph GPU tests passed in
# r9_first.sh, so they are not rerun):
# 0. the radix selection's default blocks since 2026-12-05 (4,096 columns for few rows, 512 from 512
#    rows; `radix_block`): its GPU tests and the DSA indexer's, then `bench_selection` again;
# 1. `decode-c1` int4-all at 10 layers with the radix selection now the default (the fused step of
#    r9_first.sh read 3.473 ms with keys + topk);
# 2. `kumo bench engine mtp` (BUDGET s): fixed_k_run step ms against 3.39, speedup_c1,
#    page_allocations, first_drafting_step;
# 3. the speculative step profile, nano GLM and Kimi (lab/diagnostics/spec_profile.py), last: a cut
#    call keeps what came before (each stage packs).
# Everything in $OUT/r9_second.tgz.
#   run(command="bash lab/device/r9_second.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r9s && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r9_second.tgz" -C $W .; }
timeout 120 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 100 -rfE \
  tests/kernels/test_selection_triton.py tests/kernels/test_dsa_indexer_triton.py > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E " $W/pytest.log | tail -8
timeout 90 python3 -m benchmarks.kernels.bench_selection --out $W/selection.json > $W/bench_selection.log 2>&1
echo "== bench_selection rc=$? at $(el)s"; grep -v Warning $W/bench_selection.log | tail -8
pack
timeout 150 python3 -m benchmarks.cli engine decode-c1 --formats int4-all --rounds 3 --budget-s ${C1_BUDGET:-100} \
  --out "$W/decode-c1-radix.json" > "$W/decode-c1-radix.log" 2>&1
echo "== decode-c1 radix rc=$? at $(el)s"; grep -E "^\| int4-all " "$W/decode-c1-radix.log"
pack
BUDGET=${BUDGET:-180}
timeout $(( BUDGET + 60 )) python3 -m benchmarks.cli engine mtp --budget-s "$BUDGET" --out $W/mtp-gpu.json > $W/mtp-gpu.log 2>&1
echo "== mtp bench rc=$? at $(el)s"; grep -v Warning $W/mtp-gpu.log | grep -E "speedup|c64|step_ms|acceptance|page_alloc|first_drafting" | head -40
pack
for m in glm-5.2-nano kimi-k2.6-nano; do
  timeout 120 python3 -m lab.diagnostics.spec_profile --model models/$m --out $W/spec_profile-$m.txt > $W/spec_profile-$m.log 2>&1
  echo "== profile $m rc=$? at $(el)s"; grep -A14 "== side" $W/spec_profile-$m.txt | grep -v "^---" | head -40
  pack
done
echo "== done at $(el)s"
