#!/usr/bin/env bash
# Issue 24, the MLA slice count re-fit for a mostly idle GPU (branch r5-mla-splits; ~6 min; carry [".whl"]):
#   run(command="bash lab/device/mla_splits.sh", carry=[".whl"])
# 1. gpu tests that run the new chooser (MLA decode at batch 1 to 8 and prefill, decode graphs of
#    glm-5.2 that capture it, the models on CUDA);
# 2. the batch-1 slice sweep (64 heads; 2,048 / 2,176 / 8,192 tokens): `auto` is now the idle model's
#    pick, `before` the old one's, beside every fixed count;
# 3. the decode-c1 record (input 2,048; 3.92-4.02 ms a step before: expected ~0.28 ms less, 10 layers of
#    sparse MLA at 52 -> 24 µs).
source "$(dirname "$0")/preamble.sh"
timeout 200 python3 -m pytest -n 8 -p no:cacheprovider -p no:benchmark --tb=line --timeout 180 -rfE -m gpu \
  tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py tests/backend/engine/test_decode_graphs_cuda.py \
  tests/backend/models/test_models_cuda.py > "$OUT/pytest_mla.log" 2>&1
echo "== tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" "$OUT/pytest_mla.log" | tail -15
timeout 200 python3 -m lab.diagnostics.mla_c1_splits --out "$OUT/mla_c1_splits.json" > "$OUT/mla_c1_splits.log" 2>&1
echo "== MLA slices rc=$? at $(( $(date +%s) - START ))s"; grep -E "^ctx|rel. err" "$OUT/mla_c1_splits.log"
timeout 80 python3 -m benchmarks.cli engine decode-c1 --formats int4-all --budget-s 60 \
  --out "$OUT/decode-c1-2048.json" > "$OUT/decode-c1-2048.log" 2>&1
echo "== decode-c1 (input 2048) rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/decode-c1-2048.log" | tail -4
