#!/usr/bin/env bash
# Session 17's first call, whichever GPU comes: an H200 (> 100 GB: GLM 5.2 FP8 at 78 layers fits) runs
# the full-depth INT4 / FP8 rounds in pairs (issue 25, PAIRS=1 lab/device/r7_full_depth.sh: 3 decode +
# 2-3 prefill rounds in one call); an H100 runs
# lab/device/r16.sh (issues 28, 24).
#   run(command="timeout -s KILL 590 bash lab/device/r16_any.sh", carry=[".whl"], timeout_s=600)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "== GPU memory ${mem} MiB"
if [ "${mem:-0}" -gt 100000 ]; then
  PAIRS=${PAIRS:-1} exec bash "$(dirname "$0")/r7_full_depth.sh"
fi
LIMIT=${LIMIT:-550} exec bash "$(dirname "$0")/r16.sh"
