#!/usr/bin/env bash
# GLM 5.2 INT4 / FP8 at full depth on one H200 (issue 25): rank 0 of 8, all 78 layers, which do not
# fit one process with both formats (INT4 54 + FP8 96 GB), so one side a process, processes A, B, B, A
# a round (each: build, warm-up on the whole workload, then its timed runs), 3 rounds a scenario:
#   int4_vs_fp8_decode_c1   1 x 2,048 / 256 tokens, 1 timed run a process
#   int4_vs_fp8_prefill     one 8,192-token prompt, 3 timed runs a process (after decode's 3 rounds)
# then `kumo bench engine combine` (benchmarks/engine/side_records.py) prints each key's line.
#
#   run(command="bash lab/device/r7_full_depth.sh", carry=[".whl"], timeout_s=600)
#
# Resumable: 3 rounds of each do not fit one call. Records of finished rounds land in
# $OUT/r7_full_depth.tgz (records/), a round cut short goes to partial/ (never paired). Before the
# next call: mkdir -p lab/device/r7-prior && tar -xzf .../r7_full_depth.tgz -C lab/device/r7-prior
# (untracked, so it travels): that call starts at the next round and combines the records of both.
#
# Time (LIMIT 540 s from the start; a round starts only if its estimate fits before LIMIT - 20 s exit
# margin - 15 s to combine; after a round of a scenario its own time is the estimate). At 50 layers a
# process built INT4 in 11-18 s, FP8 in 3-5 s, a c=1 run took 6.7-7.0 s (25-26 ms a step), an 8k
# prefill 1.05-1.3 s; x 78/50:
#   preamble (nvidia-smi, pip of the wheels)                                            ~15-25 s
#   decode process: start ~7 s + build (INT4 ~25 s / FP8 ~9 s) + warm-up run ~11 s (+~8 s compiling
#     on a fresh machine) + 1 run ~10.5 s + exit: A ~55 s, B ~38 s; a round (A, B, B, A)  ~185-200 s
#   prefill process: start + build + warm-up ~3 s + 3 runs of ~1.7 s: A ~41 s, B ~25 s;
#     a round                                                                           ~130-140 s
#   call 1: decode rounds 1-2                                                           ~420 s
#   call 2: decode round 3, prefill rounds 1-2                                          ~480-500 s
#   (a round over its estimate leaves the next for a third call: prefill round 3 and what is left)
# PAIRS=1: rounds of two processes, A B | B A | A B (the same process order, taken two at a time;
# `kumo bench engine combine --pairs`): half the processes a round, so 3 decode and 3 prefill rounds
# fit one call (~95 + ~65 s a round at the estimates above), each round's ratio a / b.
# DRY=1 prints the commands as planned by the estimates; TINY=1 runs them on the CPU at --tiny scale
# (rank 0 of 2: the tiny model's 4 heads do not split 8 ways). Env: ROUNDS (3), ONLY (the scenarios),
# PRIOR (lab/device/r7-prior), EST_DECODE / EST_PREFILL (s a round), LIMIT (540), PYTHON, LAYERS (a
# truncated depth, e.g. 50 on an H100 as the 2026-12-04 H200 records; default the full 78).
set -uo pipefail
TAG=r7_full_depth
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
TINY=${TINY:-0}
DRY=${DRY:-0}
LIMIT=${LIMIT:-540}
ROUNDS=${ROUNDS:-3}
PAIRS=${PAIRS:-0}
PER_ROUND=$([ "$PAIRS" = 1 ] && echo 2 || echo 4)
ONLY=${ONLY:-"int4_vs_fp8_decode_c1 int4_vs_fp8_prefill"}
PRIOR=${PRIOR:-lab/device/r7-prior}
EXIT_S=20     # a process past its deadline: the run in flight cut, the record written
COMBINE_S=15  # the combine at the end (imports torch)
PREAMBLE_S=20 # DRY: the preamble's time on the device, where the plan's clock starts
LOGS=${LOGS:-/tmp/r7-logs}/$TAG
REC=$LOGS/records
if [ "$TINY" = 0 ] && [ "$DRY" = 0 ]; then
  source "$(dirname "$0")/preamble.sh"  # the GPU's state; pip installs the carried wheels into /tmp/site
fi
mkdir -p "$OUT" "$REC" "$LOGS/partial"
export PYTHONUNBUFFERED=1
declare -A RUNS=([int4_vs_fp8_decode_c1]=1 [int4_vs_fp8_prefill]=3)
declare -A EST=([int4_vs_fp8_decode_c1]=${EST_DECODE:-$((200 * PER_ROUND / 4))}
               [int4_vs_fp8_prefill]=${EST_PREFILL:-$((140 * PER_ROUND / 4))})
SIDES=(A B B A)
layout=(--rank-of 8 --pool-scale 0.1)  # the pool: c=1 needs 2,304 tokens; 0.1 as the 50-layer records
[ -n "${LAYERS:-}" ] && layout+=(--layers "$LAYERS")  # a truncation (an H100: FP8 at 78 layers is 96 GB)
if [ "$TINY" = 1 ]; then
  layout=(--rank-of 2 --pool-scale 0.1 --tiny --device cpu ${COMPILE_CACHE:+--compile-cache "$COMPILE_CACHE"})
  EST=([int4_vs_fp8_decode_c1]=${EST_DECODE:-$((20 * PER_ROUND / 4))}
       [int4_vs_fp8_prefill]=${EST_PREFILL:-$((20 * PER_ROUND / 4))})
fi
dry_s=$PREAMBLE_S

elapsed() { if [ "$DRY" = 1 ]; then echo "$dry_s"; else echo "$SECONDS"; fi; }
left() { echo $((LIMIT - $(elapsed) - EXIT_S - COMBINE_S)); }
archive() { [ "$DRY" = 1 ] || tar -czf "$OUT/$TAG.tgz" -C "$LOGS" .; }

if [ -d "$PRIOR/records" ]; then  # the records of earlier calls: their rounds count, and combine here
  cp -n "$PRIOR"/records/*.json "$REC"/ 2>/dev/null
  echo "== prior: $(ls "$PRIOR"/records/*.json 2>/dev/null | wc -l) records from $PRIOR"
fi

rounds_done() {  # NAME: the highest round number with all its processes' records
  local name=$1 r last=0
  for f in "$REC/$name"-r*-p1-*.json; do
    [ -e "$f" ] || continue
    r=${f##*/"$name"-r}; r=${r%%-*}
    [ "$(ls "$REC/$name-r$r"-p*.json 2>/dev/null | wc -l)" -eq "$PER_ROUND" ] && [ "$r" -gt "$last" ] && last=$r
  done
  echo "$last"
}

side_of() {  # ROUND K: the side of the round's k-th process (A, B, B, A; pairs: A, B then B, A)
  if [ "$PAIRS" = 1 ]; then
    if [ $(( $1 % 2 )) = 1 ]; then echo "AB" | cut -c"$2"; else echo "BA" | cut -c"$2"; fi
  else
    echo "${SIDES[$(($2 - 1))]}"
  fi
}

process() {  # NAME ROUND K SIDE: one side in its own process, its budget what is left
  local name=$1 r=$2 k=$3 side=$4 budget rc stem
  budget=$(( $(left) + COMBINE_S ))
  stem="$name-r$r-p$k-$side"
  local cmd=("$PYTHON" -m benchmarks.cli engine scenario "$name" --side "$side" --rounds "${RUNS[$name]}"
             "${layout[@]}" --budget-s "$budget" --out "$REC/$stem.json")
  if [ "$DRY" = 1 ]; then
    echo "${cmd[*]}"
    dry_s=$((dry_s + EST[$name] / PER_ROUND))
    return 0
  fi
  timeout $((budget + 45)) "${cmd[@]}" > "$LOGS/$stem.log" 2>&1
  rc=$?
  echo "== $stem rc=$rc at ${SECONDS}s (budget ${budget}s)"
  grep -E "^\| $name/" "$LOGS/$stem.log" | sed 's/^/   /'
  archive
  [ $rc -eq 0 ] && [ -e "$REC/$stem.json" ]
}

for name in $ONLY; do
  r=$(rounds_done "$name")
  while [ "$r" -lt "$ROUNDS" ]; do
    if [ "${EST[$name]}" -gt "$(left)" ]; then
      echo "== $name round $((r + 1)): left for the next call, $(left)s left (a round ~${EST[$name]}s)"
      break
    fi
    r=$((r + 1))
    start=$(elapsed)
    ok=1
    for k in $(seq 1 "$PER_ROUND"); do
      process "$name" "$r" "$k" "$(side_of "$r" "$k")" || { ok=0; break; }
    done
    if [ $ok = 0 ]; then  # never paired: its records aside, this scenario stops for this call
      mv "$REC/$name-r$r"-p* "$LOGS/partial/" 2>/dev/null
      echo "== $name round $r: a process failed, its records moved to partial/"
      archive
      break
    fi
    [ "$DRY" = 1 ] || EST[$name]=$((SECONDS - start))
    echo "== $name round $r done at $(elapsed)s (${EST[$name]}s)"
  done
done

combine=("$PYTHON" -m benchmarks.cli engine combine "$REC" --out-dir "$LOGS/combined")
[ "$PAIRS" = 1 ] && combine+=(--pairs)
if [ "$DRY" = 1 ]; then
  echo "${combine[*]}"
elif ls "$REC"/*.json > /dev/null 2>&1; then
  "${combine[@]}" > "$LOGS/combine.log" 2>&1
  echo "== combine rc=$? at ${SECONDS}s"
  grep -E "^(int4_vs_fp8_decode_c1|int4_vs_fp8_prefill): " "$LOGS/combine.log"
fi
echo "== done at $(elapsed)s of ${LIMIT}s"
archive
