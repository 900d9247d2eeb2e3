#!/usr/bin/env bash
# Issue 26's retrain of both nano models in ONE device call on one H200 (~9 minutes):
#
#   run(command="bash lab/device/round3_train.sh", carry=[".whl"], timeout_s=600)
#
# 1. both families at once continue from the committed checkpoints (train.py --init: same sizes,
#    tokenizer and config) on the everyday mixture (models/recipes/everyday.py: tool values of any
#    city/name/number/date, word problems in everyday settings, greetings and one-liners, Kimi scenes of
#    48-512 px, GLM thinking traces with 15% thinking-off requests), fresh items past every index the
#    earlier stages used (--first-item), TRAIN_MINUTES (5.0) of training;
# 2. the MTP layer retrained on each new target (train_mtp.py on the GPU, from the committed layer:
#    MTP_ITEMS (60,000) text items, MTP_BATCH_TOKENS (65,536), MTP_LR (1e-3), MTP_MINUTES (2.5) of
#    training after its data prep (~30-40 s, logged), cut to the time left before DEADLINE_S less 60 s),
#    installed into the checkpoint;
# 3. $OUT/<name>.tar for both (each ~14 MB: the two weight shards, mtp.safetensors, tokenizer, logs) and
#    $OUT/<family>.stdout, $OUT/<family>-mtp.stdout: six files.
# SKIP_MTP=1: the continued training only (a first call of two; the second continues from its output,
# untarred into models/, and trains the MTP layers). ITEMS_GLM/ITEMS_KIMI, LR, MIX override the defaults.
# Afterwards: untar both into models/ and run the held-out "after" eval (models/README.md, issue 26).
# CPU dry run of the logic (tiny budgets, no wheels needed when the venv has transformers 5.24):
#   OUT=/tmp/r3 PYTHON=/work/main/.venv/bin/python DEVICE=cpu ITEMS_GLM=300 ITEMS_KIMI=200 TRAIN_MINUTES=0.2 \
#     MTP_MINUTES=0.1 MTP_ITEMS=100 BATCH_TOKENS=2048 MTP_BATCH_TOKENS=1024 WORKERS=1 bash lab/device/round3_train.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
TRAIN_MINUTES=${TRAIN_MINUTES:-5.0}
MTP_MINUTES=${MTP_MINUTES:-2.5}
FIRST_ITEM=${FIRST_ITEM:-300000}  # the reading stages used items up to ~210,000 of each task
DEVICE_ARGS=${DEVICE:+--device $DEVICE}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-550}  # the MTP stage is cut here, so the tars always come back inside the call
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # transformers 5.24 (+ regex, tokenizers) first on the path, as train_models.sh
  rm -rf /tmp/tf; $PY -m pip install -q --no-deps --target /tmp/tf .whl/transformers-*.whl .whl/regex-*.whl \
    .whl/tokenizers-*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/tf:$PWD
else
  export PYTHONPATH=$PWD
fi
$PY -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())" || exit 3
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# the everyday mixture: tools, word problems and chat lead; the reading tasks stay so they are not forgotten
MIX=${MIX:-gsm-nano=0.22,tool-call=0.24,chat=0.14,arc-nano-easy=0.08,arc-nano-challenge=0.06,mmlu-nano=0.08}
stage() {  # stage <family>: data, the continued training, the MTP layer, installed
  local fam=$1 name items workers
  name=$([ "$fam" = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
  items=$([ "$fam" = kimi ] && echo "${ITEMS_KIMI:-100000}" || echo "${ITEMS_GLM:-150000}")
  workers=${WORKERS:-$([ "$fam" = kimi ] && echo 10 || echo 5)}  # Kimi's scenes are the slow ones to render
  local mix=$MIX; [ "$fam" = kimi ] && mix=$mix,image-qa=0.1,image-caption=0.08
  local t0=$SECONDS
  rm -rf "/tmp/r3-$fam" "$OUT/$name" "/tmp/r3-mtp-$fam"
  $PY -m models.recipes.build --out "/tmp/r3-$fam" --family "$fam" --train-items "$items" --test-items 10 \
    --first-item "$FIRST_ITEM" --mixture "$mix" || return 4
  echo "data built in $((SECONDS - t0)) s"
  # bounded: a hung stage (a rendering pool that died, 2026-12-04) must not take the other family's result
  local bound=$((DEADLINE_S - ($(date +%s) - START)))
  [ "$bound" -gt 0 ] || { echo "no time left to train"; return 5; }  # (timeout 0 would mean no bound)
  timeout "$bound" $PY -m models.recipes.train --family "$fam" --data "/tmp/r3-$fam" --out "$OUT/$name" --init "models/$name" \
    --steps 0 --minutes "$TRAIN_MINUTES" --batch-tokens "${BATCH_TOKENS:-65536}" --lr "${LR:-1.5e-3}" \
    --warmup "${WARMUP:-50}" --workers "$workers" $DEVICE_ARGS || return 5
  echo "trained at $((SECONDS - t0)) s"
  if [ -n "${SKIP_MTP:-}" ]; then  # packed now, so the other family's stage cannot lose it
    echo "SKIP_MTP: no MTP stage (the checkpoint has no MTP layer)"
    tar -C "$OUT" -cf "$OUT/$name.tar" "$name" && rm -rf "${OUT:?}/$name"
    return 0
  fi
  # the MTP layer for the new target, from the committed layer, cut at the deadline; installed only when
  # it finished (a separate step, never interrupted: a cut stage leaves the checkpoint without MTP, as
  # train.py wrote it, num_nextn_predict_layers 0)
  local left=$((DEADLINE_S - ($(date +%s) - START)))
  echo "MTP stage: $left s left before the deadline"
  [ "$left" -gt 90 ] || { echo "no time left for the MTP stage (the checkpoint has no MTP layer)"; return 6; }
  # the training clock starts after the start-up and data prep (~30-40 s, logged); the save takes ~1 s
  local minutes; minutes=$(awk -v l="$left" -v m="$MTP_MINUTES" 'BEGIN { x = (l - 60) / 60; printf "%.2f", x < m ? x : m }')
  echo "MTP stage: $minutes minutes of training"
  timeout "$left" $PY -m models.recipes.train_mtp --family "$fam" --data "/tmp/r3-$fam" --checkpoint "$OUT/$name" \
    --out "/tmp/r3-mtp-$fam" --init "models/$name" --minutes "$minutes" --max-items "${MTP_ITEMS:-60000}" \
    --batch-tokens "${MTP_BATCH_TOKENS:-65536}" --lr "${MTP_LR:-1e-3}" --warmup 20 --workers "$workers" \
    $DEVICE_ARGS > "$OUT/$fam-mtp.stdout" 2>&1 || { echo "MTP stage failed or cut (the checkpoint has no MTP layer)"; return 6; }
  $PY -c "import sys; from pathlib import Path; from models.recipes.train_mtp import install; install(Path(sys.argv[1]), Path(sys.argv[2]))" \
    "/tmp/r3-mtp-$fam" "$OUT/$name" || return 7
  local n=1; while [ -e "$OUT/$name/train_mtp.$n.log" ]; do n=$((n + 1)); done
  [ -e "$OUT/$name/train_mtp.log" ] && mv "$OUT/$name/train_mtp.log" "$OUT/$name/train_mtp.$n.log"
  cp "/tmp/r3-mtp-$fam/train.log" "$OUT/$name/train_mtp.log"
  echo "MTP installed at $((SECONDS - t0)) s"
}
pids=()
for fam in kimi glm; do
  stage $fam > "$OUT/$fam.stdout" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for name in kimi-k2.6-nano glm-5.2-nano; do
  [ -d "$OUT/$name" ] && tar -C "$OUT" -cf "$OUT/$name.tar" "$name" && rm -rf "${OUT:?}/$name"
done
rm -rf "$OUT"/.*.staging
for fam in kimi glm; do
  echo "== $fam"; grep -vE "step [0-9]+ " "$OUT/$fam.stdout" | tail -8
  grep -E "step [0-9]+ " "$OUT/$fam.stdout" | awk 'NR%20==1' | tail -8
  echo "-- mtp"; tail -4 "$OUT/$fam-mtp.stdout" 2>/dev/null
done
ls -la "$OUT"
exit $rc
