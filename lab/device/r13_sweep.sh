#!/usr/bin/env bash
# Issue 24: the GEMV and fused-MoE configs on GLM 5.2's rank-0-of-8 decode shapes, one H100 or H200, <= ~230 s,
# never run on a GPU. The rank-of-8 profile (lab/results/2026-12-05-r12/prof-r8.json) spends 3.5 ms of the c=1
# step in 546 W4A16 GEMV calls (~6.5 us each on 1-10 MB matrices) and 1.8 ms in 150 fused-MoE kernels (~12 us,
# ~1 of 8 experts local); lab/diagnostics/rank_of_sweep times the launchers' configs against alternatives on
# exactly those shapes (graphs of >= 20 launches, PDL on, A/B/B/A, copy bandwidth in the same run).
# Follow-up: where a candidate beats the launcher by more than its spread on the shapes that carry the step,
# set it in kernels/w4a16_config.py (GEMV_DEFAULT / GEMV_PROGRAMS_PER_SM / GEMV_NARROW) or
# kernels/moe_routing.py (GEMV_CONFIG / GEMV_PROGRAMS_PER_SM) and re-run the rank-of-8 profile.
# Everything in $OUT/r13_sweep.tgz.
#   run(command="bash lab/device/r13_sweep.sh", carry=[".whl"], timeout_s=300)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r13s && rm -rf $W && mkdir -p $W
timeout 230 python3 -m lab.diagnostics.rank_of_sweep --budget-s 180 --out $W/rank_of_sweep.json > $W/rank_of_sweep.log 2>&1
echo "== rank-of-8 sweep rc=$? at $(( $(date +%s) - START ))s"
grep -v -E "Warn|warn" $W/rank_of_sweep.log | grep -E "^  gemv|^  moe|^gemv|^moe|=>|copy|budget" | head -60
tar czf "$OUT/r13_sweep.tgz" -C $W .
