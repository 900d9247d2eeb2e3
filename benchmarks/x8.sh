#!/usr/bin/env bash
# The 8-GPU run (issue 23): Kimi K2.6 and GLM 5.2 at full depth, random weights made on the GPUs in
# each format, the published configs (models/configs/), the real layout TP8 / EP8 (a group of 8
# processes over NCCL: `kumo bench engine scenario … --tp 8`). One part a call, each inside 10 minutes;
# records and logs land in $OUT, and every call ends by printing the run's summary so far
# (python -m benchmarks.engine.x8 $OUT: $OUT/<date>-x8.json + .md). benchmarks/README.md, "The 8-GPU run".
#
# In priority order (A/B parts run A B B A, as the method asks: each four a round, one sample of the
# ratio; a missing or failed call costs its own round only):
#   bash benchmarks/x8.sh glm-decode A|B        # 1. GLM 5.2 tok/s per user at c=1, A = INT4, B = FP8
#   bash benchmarks/x8.sh glm-prefill A|B       #    prefill tok/s of one 8,192-token prompt
#   bash benchmarks/x8.sh kv-long A|B           # 2. Kimi K2.6 64 × 16,384 / 4,096 at once, A = FP8 KV, B = BF16
#   bash benchmarks/x8.sh kv-capacity A|B       #    KV tokens held when the pool first preempts
#   bash benchmarks/x8.sh kv-capacity-dcp8 A|B  #    the same with --dcp 8
#   bash benchmarks/x8.sh load C                # 3. Kimi INT4 experts + FP8 KV, 8k / 1k at concurrency C
#                                               #    (1, 4, 16, 32, 64: one call each)
#   bash benchmarks/x8.sh tags                  # 4. page-tag check on / off at c=64, A/B/B/A in one call
#   bash benchmarks/x8.sh comms C               # 5. a profiled decode step at c=C (1, 64): collectives' share
#   bash benchmarks/x8.sh report                # the summary again
# Rehearsals: RANK_OF=8 bash benchmarks/x8.sh PART …   rank 0 of 8 alone on one GPU (collectives local)
#             bash benchmarks/x8.sh rehearse           every part, tiny geometry, --tp 2 on the CPU (gloo)
# Env: OUT (default /tmp/out), BUDGET (s a part may measure, default 420), ROUNDS (timed runs a part),
# TP (default 8). A `.whl` folder in the repository root (lab/device/device_plan.sh) is installed first.
set -uo pipefail
stage=${1:?"glm-decode|glm-prefill|kv-long|kv-capacity|kv-capacity-dcp8 A|B, load C, tags, comms C, report, rehearse"}
part=${2:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TP=${TP:-8}
RANK_OF=${RANK_OF:-}
layout=(--tp "$TP")
extra=()

if [ "$stage" = rehearse ]; then  # the CPU rehearsal: every part at the tiny geometry, 2 ranks over gloo
  TP=2
  layout=(--tp 2)
  extra=(--tiny --device cpu --rounds 1)
  BUDGET=${BUDGET:-60}
else
  BUDGET=${BUDGET:-420}
fi
case $stage in  # the part's argument, checked before anything is installed or started
  glm-decode|glm-prefill|kv-long|kv-capacity|kv-capacity-dcp8)
    case ${part:-} in A|B) ;; *) echo "x8.sh: $stage takes A or B (got '${part:-}')" >&2; exit 2 ;; esac ;;
  load|comms)
    [[ ${part:-} =~ ^[0-9]+$ ]] || { echo "x8.sh: $stage takes a concurrency (got '${part:-}')" >&2; exit 2; } ;;
esac
if [ "$stage" != rehearse ] && [ "$stage" != report ]; then  # the GPUs, then the machine's state
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || gpus=0
  if [ -n "$RANK_OF" ]; then  # one GPU stands in for rank 0 of RANK_OF
    [ "$gpus" -ge 1 ] || { echo "x8.sh: RANK_OF=$RANK_OF needs one GPU; nvidia-smi -L lists none" >&2; exit 2; }
    layout=(--rank-of "$RANK_OF")
  elif [ "$gpus" -lt "$TP" ]; then
    echo "x8.sh: this run needs $TP GPUs on one host (TP$TP / EP$TP); nvidia-smi -L lists $gpus." >&2
    echo "x8.sh: to rehearse a part on one GPU: RANK_OF=8 bash benchmarks/x8.sh $stage $part" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader \
    | tee -a "$OUT/machine.txt"
  if [ -d .whl ]; then
    rm -rf /tmp/site && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}

side() {  # A or B
  case $part in A|B) ;; *) echo "x8.sh: $stage takes A or B (got '${part}')" >&2; exit 2 ;; esac
}
concurrency() {
  [[ $part =~ ^[0-9]+$ ]] || { echo "x8.sh: $stage takes a concurrency (got '${part}')" >&2; exit 2; }
}

scenario() {  # NAME_OF_RECORD SCENARIO ARGS…: one `kumo bench engine scenario`, its log and record in $OUT
  local tag=$1; shift
  local name
  name="$tag-$(date -u +%H%M%S)"
  echo "== $name: kumo bench engine scenario $* ${layout[*]} ${extra[*]}"
  timeout $((BUDGET + 170)) $PY -m benchmarks.cli engine scenario "$@" "${layout[@]}" "${extra[@]}" \
    --budget-s "$BUDGET" --compile-cache "${COMPILE_CACHE:-$HOME/.triton/cache}" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { echo "x8.sh: $name exited $rc; the log's end:" >&2; grep -v Warning "$OUT/$name.log" | tail -25 >&2; }
  return $rc
}

rounds() { [ -n "${ROUNDS:-}" ] && echo --rounds "$ROUNDS"; }

run_part() {
  local stage=$1 part=$2
  case $stage in
    glm-decode) side; scenario "glm-decode-$part" int4_vs_fp8_decode_c1 --side "$part" $(rounds) \
      ${FP8_METHOD:+--fp8-method $FP8_METHOD} ;;
    glm-prefill) side; scenario "glm-prefill-$part" int4_vs_fp8_prefill --side "$part" $(rounds) \
      ${FP8_METHOD:+--fp8-method $FP8_METHOD} ;;
    # one timed run a call; warmed on 64 × 2,048 / 128 (the same chunk and decode widths, in seconds)
    kv-long) side; scenario "kv-long-$part" fp8kv_vs_bf16kv_long_c64 --side "$part" --rounds "${ROUNDS:-1}" \
      --warm-up-lengths ${WARM_LENGTHS:-2048 128} ${POOL:+--pool-scale $POOL} ;;
    # a count, not a timing: no warm-up; enough sequences at once that the prompts fill the pool
    kv-capacity) side; scenario "kv-capacity-$part" capacity_fp8_over_bf16 --side "$part" --no-warm-up \
      --concurrency "${SEQS:-256}" --chunk 8192 ${POOL:+--pool-scale $POOL} ;;
    kv-capacity-dcp8) side; scenario "kv-capacity-dcp8-$part" capacity_fp8_over_bf16 --side "$part" --no-warm-up \
      --dcp "${DCP:-8}" --concurrency "${SEQS:-1024}" --chunk 8192 ${POOL:+--pool-scale $POOL} ;;
    load) concurrency; scenario "load-c$part" fp8kv_vs_bf16kv_c1 --side A --concurrency "$part" \
      --input-len "${INPUT_LEN:-8192}" --output-len "${OUTPUT_LEN:-1024}" --rounds "${ROUNDS:-3}" ;;
    # both sides in one process (each its own pool: two fit at this scale), A/B/B/A rounds
    tags) scenario tags integrity_overhead --pool-scale "${TAGS_POOL:-0.45}" $(rounds) ;;
    comms) concurrency; scenario "comms-c$part" fp8kv_vs_bf16kv_c1 --side A --concurrency "$part" \
      --input-len "${INPUT_LEN:-2048}" --output-len "${OUTPUT_LEN:-64}" --rounds 1 --profile ;;
    report) ;;
    *) echo "x8.sh: no part '$stage'" >&2; exit 2 ;;
  esac
}

status=0
if [ "$stage" = rehearse ]; then
  # fp8-channel: the tiny GLM's 128 × 128 FP8 blocks do not align with rank 1's slice (the real one's do)
  export POOL=0.002 SEQS=64 INPUT_LEN=24 OUTPUT_LEN=6 DCP=2 FP8_METHOD=fp8-channel WARM_LENGTHS="16 4"
  parts=()
  for s in glm-decode glm-prefill kv-long kv-capacity kv-capacity-dcp8; do  # one round A, B, B, A each
    parts+=("$s A" "$s B" "$s B" "$s A")
  done
  for p in "${parts[@]}" "load 1" "load 4" "tags" "comms 4"; do
    read -r s part <<< "$p"
    run_part "$s" "${part:-}" || status=1
  done
else
  run_part "$stage" "$part" || status=1
fi
$PY -m benchmarks.engine.x8 "$OUT" || status=1
exit $status
