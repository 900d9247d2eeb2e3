#!/usr/bin/env bash
# Session 12's launch cuts on the decode path (issue 24), one H100 or H200, <= ~330 s, never run on a GPU:
# SiLU·up in one launch (kernels/act_mul*.py), the DSA query tiles once a step, the indexer's weight scale
# folded into its score scale and its bf16 -> fp32 cast into the quantized GEMV, and the MoE router's
# cast + cuBLAS fp32 GEMV replaced by one Triton launch at T <= 8 (kernels/router_logits.py: keep it only
# if the A/B says it is not slower; `git revert 5a357a7` otherwise).
# 1. GPU tests of what changed (<= 150 s);
# 2. lab/diagnostics/router_gemv_ab: the router kernel against cast + cuBLAS, E 256, H 6144, T 1 and 2;
# 3. the rank-of-8 profile, PDL on (2,763 kernels a step and p50 12.25 ms on the H200 before these cuts;
#    expect ~2,532).
# Everything in $OUT/r12_diet.tgz, packed after each stage.
#   run(command="bash lab/device/r12_diet.sh", carry=[".whl"], timeout_s=400)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r12d && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r12_diet.tgz" -C $W .; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_router_logits.py tests/kernels/test_w4a16_gemm.py tests/kernels/test_int4_linear.py \
  tests/kernels/test_act_mul.py tests/kernels/test_dsa_indexer_triton.py \
  tests/backend/models/test_models_cuda.py > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E " $W/pytest.log | tail -10
pack
timeout 60 python3 -m lab.diagnostics.router_gemv_ab > $W/router_ab.log 2>&1
echo "== router A/B rc=$? at $(el)s"; grep -v Warn $W/router_ab.log | tail -12
pack
timeout 130 python3 -m lab.diagnostics.decode_c1_profile --formats int4-all --layers 78 --rank-of 8 --steps 10 \
  --pdl on --top 30 --out $W/profile-rank-of-8.json > $W/profile-rank-of-8.log 2>&1
echo "== rank-of-8 profile rc=$? at $(el)s"; grep -v -E "Warning|warn|USDT|profiler" $W/profile-rank-of-8.log | head -34
pack
echo "== done at $(el)s"
