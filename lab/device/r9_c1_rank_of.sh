#!/usr/bin/env bash
# Session 9 (issue 24): the c=1 decode step over the bytes a token reads at rank 0 of 8, full depth
# (GLM 5.2, 78 of 78 layers: `kumo bench engine decode-c1 --rank-of 8`), one process a format so each
# starts on an empty H200 (INT4 every Linear ~54 GB, then FP8 every Linear ~96 GB by `kumo plan`):
#   int4-all   3 A/B/B/A rounds (A the decode run's median step, B the bytes at copy speed)
#   fp8-all    3 rounds
# then the two records merged: decode-c1-rank-of-8.json, summary key decode_c1_bytes_ratio_rank_of_8
# (goal <= 2.5x), the collectives' modelled NVLink time and the ratio with it beside. Everything in
# $OUT/r9_c1_rank_of.tgz.
#
#   run(command="bash lab/device/r9_c1_rank_of.sh", carry=[".whl"], timeout_s=600)
#
# Time (LIMIT 540 s; a format's budget is cut to what is left less EXIT_S and the merge; under
# MIN_S left it is skipped, said so). By the r7 full-depth records (rank 0 of 8, 50 layers: INT4 built
# in 11-18 s, FP8 in 3-5 s, 25-26 ms a c=1 step; x 78/50):
#   preamble (nvidia-smi, pip of the wheels)                                       ~15-25 s
#   a process: start ~7 s + build (INT4 ~25 s, FP8 ~9 s) + the collective probe (one eager
#     step) + warm-up run (2,048 + 128 tokens, graphs captured; +~8 s compiling on a fresh
#     machine) ~15 s + 3 rounds of 2 runs (~5 s each) and 2 copies ~30 s + exit  INT4 ~90 s, FP8 ~75 s
#   merge                                                                           ~5 s
# so ~200 s by the estimates; each budget (BUDGET_S, 230) leaves both room to run over 2x.
#
# CPU dry run (no preamble: the tiny geometry at rank 0 of 2, since the tiny model's 4 heads do not
# split 8 ways; seconds):
#   TINY=1 OUT=/tmp/r9 PYTHON=/work/main/.venv/bin/python bash lab/device/r9_c1_rank_of.sh
# DRY=1 prints the device's commands instead (tests/benchmarks/test_r9_c1_rank_of_script.py parses them).
set -uo pipefail
TAG=r9_c1_rank_of
TINY=${TINY:-0}
DRY=${DRY:-0}
LIMIT=${LIMIT:-540}
BUDGET_S=${BUDGET_S:-230}
EXIT_S=30   # a process past its budget: the run in flight cut, the record written
MERGE_S=15  # the merge at the end (imports torch)
MIN_S=90    # less than this left: the format is skipped
PYTHON=${PYTHON:-python3}
if [ "$TINY" = 0 ] && [ "$DRY" = 0 ]; then
  source "$(dirname "$0")/preamble.sh"  # $OUT, START, the GPU's state; the carried wheels on the path
else
  OUT=${OUT:-/tmp/out}
  START=$(date +%s)
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
fi
W=${LOGS:-/tmp/r9-logs}/$TAG
rm -rf "$W" && mkdir -p "$W"
RANK=8
layout=(--rank-of 8)
if [ "$TINY" = 1 ]; then
  RANK=2
  layout=(--rank-of 2 --tiny --device cpu)
fi
el() { if [ "$DRY" = 1 ]; then echo 20; else echo $(( $(date +%s) - START )); fi; }
archive() { [ "$DRY" = 1 ] || tar czf "$OUT/$TAG.tgz" -C "$W" .; }

c1() {  # c1 FORMAT: one decode-c1 record at rank 0 of $RANK, full depth, 3 rounds
  local fmt=$1 budget=$BUDGET_S left rc
  left=$(( LIMIT - $(el) - EXIT_S - MERGE_S ))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt "$MIN_S" ]; then echo "== decode-c1 $fmt: skipped (${left}s left)"; return; fi
  local cmd=("$PYTHON" -m benchmarks.cli engine decode-c1 "${layout[@]}" --formats "$fmt" --rounds 3
             --budget-s "$budget" --out "$W/decode-c1-rank-of-$RANK-$fmt.json")
  if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return; fi
  timeout $(( budget + EXIT_S )) "${cmd[@]}" > "$W/decode-c1-$fmt.log" 2>&1
  rc=$?
  echo "== decode-c1 --rank-of $RANK $fmt rc=$rc at $(el)s (budget ${budget}s)"
  grep -E "^\| $fmt |^\`decode_c1|^With the|skipped" "$W/decode-c1-$fmt.log" | sed 's/^/   /'
  archive
}

records=()
for fmt in int4-all fp8-all; do
  c1 "$fmt"
  rec="$W/decode-c1-rank-of-$RANK-$fmt.json"
  if [ "$DRY" = 1 ] || [ -e "$rec" ]; then records+=("$rec"); fi
done
merge=("$PYTHON" -m benchmarks.cli engine decode-c1 --merge "${records[@]}" --out "$W/decode-c1-rank-of-$RANK.json")
if [ "$DRY" = 1 ]; then
  echo "${merge[*]}"
elif [ ${#records[@]} -gt 0 ]; then
  "${merge[@]}" > "$W/merge.log" 2>&1
  echo "== merge rc=$? at $(el)s"
  grep -E "^\`decode_c1|^With the|^\| " "$W/merge.log" | sed 's/^/   /'
fi
echo "== done at $(el)s of ${LIMIT}s"
archive
