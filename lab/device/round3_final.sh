#!/usr/bin/env bash
# The session's last call (~8 min; carry [".whl"]): what merged is checked on CUDA, then measured.
#   run(command="bash lab/device/round3_final.sh", carry=[".whl"])
# 1. gpu tests of the merged work (fused RMSNorm/rotary/router/DSA selection kernels, the models on CUDA,
#    verify/draft graphs, decode graphs, warm-up compiles nothing late, rank-of graphs, INT4 MoE);
# 2. the c=1 decode profile (kernels per step; was 1,540 and 5.46 ms of device time);
# 3. the decode-c1 record, all four formats (A/B/B/A against the copy probe);
# 4. the INT4 MoE / W4A16 candidate sweep (lab/diagnostics/moe_round3_sweep.py), what time is left.
source "$(dirname "$0")/preamble.sh"
timeout 150 python3 -m pytest -n 8 -p no:cacheprovider -p no:benchmark --tb=line --timeout 130 -rfE \
  tests/kernels/test_rms_norm.py tests/kernels/test_rope.py tests/kernels/test_router.py \
  tests/kernels/test_selection_triton.py tests/kernels/test_query_tiles.py tests/kernels/test_dsa_indexer_triton.py \
  tests/backend/models/test_models_cuda.py tests/backend/engine/test_speculative_cuda.py \
  tests/backend/engine/test_decode_graphs_cuda.py tests/backend/server/test_warmup.py tests/benchmarks/test_rank_of.py \
  tests/kernels/test_fused_moe.py > "$OUT/pytest_final.log" 2>&1
echo "== tests at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout" "$OUT/pytest_final.log" | tail -25
timeout 70 python3 -m lab.diagnostics.decode_c1_profile --formats int4-all --graphs 1 \
  --out "$OUT/decode_c1_profile.json" > "$OUT/decode_c1_profile.log" 2>&1
echo "== profile at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/decode_c1_profile.log" | grep -v "^USDT" | tail -32
timeout 150 python3 -m benchmarks.cli engine decode-c1 --formats int4,int4-all,fp8,fp8-all --budget-s 100 \
  --out "$OUT/decode-c1.json" > "$OUT/decode-c1.log" 2>&1
echo "== decode-c1 rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/decode-c1.log" | tail -12
left=$(( 470 - ($(date +%s) - START) ))
if [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m lab.diagnostics.moe_round3_sweep --out "$OUT/moe_round3.json" > "$OUT/moe_round3.log" 2>&1
  echo "== moe sweep rc=$? at $(( $(date +%s) - START ))s"; grep -E "=>|copy [0-9]" "$OUT/moe_round3.log" | tail -20
fi
