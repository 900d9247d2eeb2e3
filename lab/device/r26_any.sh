#!/usr/bin/env bash
# Session 26, whichever GPU comes: an H200 (> 100 GB) runs issue 25's full-depth INT4 / FP8 rounds
# (PAIRS=1 lab/device/r7_full_depth.sh, never run: the H200 never came in sessions 16, 18-25); an H100
# runs lab/device/${H100_SCRIPT:-r26.sh} (issue 28).
#   run(command="timeout -s KILL 590 bash lab/device/r26_any.sh", carry=[".whl"], timeout_s=600, kind="nvidia-h200")
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "== GPU memory ${mem} MiB"
if [ "${mem:-0}" -gt 100000 ]; then
  PAIRS=${PAIRS:-1} exec bash "$(dirname "$0")/r7_full_depth.sh"
fi
exec bash "$(dirname "$0")/${H100_SCRIPT:-r26.sh}"
