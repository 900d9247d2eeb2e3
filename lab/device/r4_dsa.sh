#!/usr/bin/env bash
# The DSA skip and the c=1 MLA slice sweep on the H200 (~8 min; carry [".whl"]):
#   run(command="bash lab/device/r4_dsa.sh", carry=[".whl"])
# 1. gpu tests the change touches (decode graphs of glm-5.2 replay both widths: B=3 crosses index_topk
#    64 mid-decode; MLA decode incl. sparse; the indexer; models on CUDA);
# 2. the A/B of the skip at a context within index_topk (input 1,920 + 128 out), one build per arm;
# 3. the decode-c1 record as recorded (input 2,048: past the top-k, expected unchanged: 3.92 ms);
# 4. the MLA slice-count sweep at batch 1 (64 heads; 2,048 / 2,176 / 8,192 tokens), what time is left.
source "$(dirname "$0")/preamble.sh"
timeout 170 python3 -m pytest -n 8 -p no:cacheprovider -p no:benchmark --tb=line --timeout 150 -rfE \
  tests/backend/engine/test_decode_graphs_cuda.py tests/kernels/test_mla_decode.py \
  tests/kernels/test_dsa_indexer_triton.py tests/backend/models/test_models_cuda.py > "$OUT/pytest_dsa.log" 2>&1
echo "== tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" "$OUT/pytest_dsa.log" | tail -15
timeout 150 python3 -m lab.diagnostics.dsa_skip_ab --input-len 1920 --rounds 2 --budget-s 130 \
  --out "$OUT/dsa_skip_ab.json" > "$OUT/dsa_skip_ab.log" 2>&1
echo "== skip A/B rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/dsa_skip_ab.log" | tail -6
timeout 80 python3 -m benchmarks.cli engine decode-c1 --formats int4-all --budget-s 60 \
  --out "$OUT/decode-c1-2048.json" > "$OUT/decode-c1-2048.log" 2>&1
echo "== decode-c1 (input 2048) rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/decode-c1-2048.log" | tail -4
left=$(( 470 - ($(date +%s) - START) ))
if [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m lab.diagnostics.mla_c1_splits --out "$OUT/mla_c1_splits.json" > "$OUT/mla_c1_splits.log" 2>&1
  echo "== MLA slices rc=$? at $(( $(date +%s) - START ))s"; grep -E "^ctx" "$OUT/mla_c1_splits.log"
fi
