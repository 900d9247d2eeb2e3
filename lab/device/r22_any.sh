#!/usr/bin/env bash
# Session 22's call, whichever GPU comes (a call without needs_h200 gets an H100 or an H200): an H200
# (> 100 GB: GLM 5.2 FP8 at 78 layers fits) runs issue 25's full-depth INT4 / FP8 rounds in pairs
# (PAIRS=1 lab/device/r7_full_depth.sh); an H100 runs NEXT.md's row 2 (issues 24, 28): the 8 MLA decode
# GPU tests never reached, then the mtp bench calibrated and not (lab/device/r20.sh).
#   run(command="timeout -s KILL 590 bash lab/device/r22_any.sh", carry=[".whl"], timeout_s=600, kind="nvidia-h200")
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "== GPU memory ${mem} MiB"
if [ "${mem:-0}" -gt 100000 ]; then
  PAIRS=${PAIRS:-1} exec bash "$(dirname "$0")/r7_full_depth.sh"
fi
export TESTS=tests/kernels/test_mla_decode.py
export K="tile_variants_match_reference or tampered_and_sparse or replays_in_a_cuda_graph"
TESTS_S=150 VARIANTS="cal nocal" BUDGET=170 exec bash "$(dirname "$0")/r20.sh"
