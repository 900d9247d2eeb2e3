#!/usr/bin/env bash
# Two independent single-GPU stages side by side on nvidia-h200-x2 (~9.5 min; carry [".whl"]):
#   run(command="bash lab/device/r5_pair.sh", carry=[".whl"], kind="nvidia-h200-x2")
# GPU 0: issue 28's speculative record with graphs (lab/device/mtp.sh bench, BUDGET 400);
# GPU 1: issue 24's DSA skip + MLA slice sweep (lab/device/r4_dsa.sh).
# Each stage writes under its own $OUT subfolder; the host's 32 cores are shared (the record says so).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/mtp" "$OUT/dsa"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
( CUDA_VISIBLE_DEVICES=0 OUT=$OUT/mtp BUDGET=${BUDGET:-400} bash lab/device/mtp.sh bench > "$OUT/mtp/stage.log" 2>&1 ) &
mtp_pid=$!
sleep 5  # the two wheel installs into /tmp/site must not race: r4_dsa's preamble uses its own target
( CUDA_VISIBLE_DEVICES=1 OUT=$OUT/dsa SITE=/tmp/site1 bash lab/device/r4_dsa.sh > "$OUT/dsa/stage.log" 2>&1 ) &
dsa_pid=$!
wait $mtp_pid; echo "== mtp rc=$?"; tail -30 "$OUT/mtp/stage.log"
wait $dsa_pid; echo "== dsa rc=$?"; tail -30 "$OUT/dsa/stage.log"
