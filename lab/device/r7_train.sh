#!/usr/bin/env bash
# Issue 26's third everyday retrain, both nano models in ONE device call on one H200 (≤ ~565 s):
#
#   run(command="bash lab/device/r7_train.sh", carry=[".whl"], timeout_s=600)
#
# 1. both families at once continue from the committed checkpoints (train.py --init: same sizes, tokenizer,
#    config) on the recipe of lab/results/2026-12-04-r6/recipe26/ (tool values from generators too large to
#    learn by heart, framed phrasings, word problems with composed step sentences and one-liners in words),
#    fresh items from FIRST_ITEM (800,000: past every index the earlier stages used), 200,000 (GLM) / 120,000
#    (Kimi), TRAIN_MINUTES (3.6) of training after ~110 s of wheels, data and rendering;
# 2. each MTP layer retrained on its new target (train_mtp.py, from the committed layer), MTP_MINUTES (1.5)
#    cut to the time left before MTP_END_S (455 s) less its ~60 s of start-up and data prep, installed;
# 3. the held-out everyday sets (backend/tools/eval_heldout.py, HELDOUT_ITEMS (300) a set, seed 26) on the
#    GPU, before (the committed folder) against after, paired, cut at EVAL_END_S (560 s);
# 4. one tarball a checkpoint folder (with train.log, train_mtp.log), $OUT/<name>.tar (~13 MB: a file
#    comes back only under 16 MiB, so the 27.6 MB tarball of both that session 11 wrote was lost), and
#    $OUT/r7_train-logs.tar (the stdout logs and heldout-<family>.json). FAMILIES ("kimi glm") picks.
#    A stage cut short leaves what it had (a checkpoint without its MTP layer: num_nextn_predict_layers
#    0, then train_mtp.py runs on its own).
# Afterwards, on the CPU: bash lab/diagnostics/nano_heldout_after.sh <files_at> (the folder of the <name>.tar).
# CPU dry run of the logic (tiny budgets; the venv's own packages):
#   OUT=/tmp/r7 NO_WHL=1 PYTHON=/work/main/.venv/bin/python DEVICE=cpu ITEMS_GLM=300 ITEMS_KIMI=200 \
#     TRAIN_MINUTES=0.2 MTP_ITEMS=100 BATCH_TOKENS=2048 MTP_BATCH_TOKENS=1024 WORKERS=1 HELDOUT_ITEMS=4 \
#     MTP_END_S=400 EVAL_END_S=560 bash lab/device/r7_train.sh
set -uo pipefail
source "$(dirname "$0")/preamble.sh"  # $OUT, START, the carried wheels on the path (NO_WHL: not)
PY=${PYTHON:-python3}
TRAIN_MINUTES=${TRAIN_MINUTES:-3.6}
MTP_MINUTES=${MTP_MINUTES:-1.5}
FIRST_ITEM=${FIRST_ITEM:-800000}  # the second everyday retrain used items 500,000-750,000 of each task
MTP_END_S=${MTP_END_S:-455}   # the MTP stages end here, leaving the held-out eval its ~100 s
EVAL_END_S=${EVAL_END_S:-560} # then the tarball
DEVICE_ARGS=${DEVICE:+--device $DEVICE}
W=/tmp/r7w && rm -rf $W && mkdir -p $W
$PY -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())" || exit 3
# the mixture of the second everyday retrain: tools, word problems and chat lead; reading stays
MIX=${MIX:-gsm-nano=0.22,tool-call=0.24,chat=0.14,arc-nano-easy=0.08,arc-nano-challenge=0.06,mmlu-nano=0.08}
stage() {  # stage <family>: data, the continued training, the MTP layer (installed), the held-out sets
  local fam=$1 name items workers
  name=$([ "$fam" = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
  items=$([ "$fam" = kimi ] && echo "${ITEMS_KIMI:-120000}" || echo "${ITEMS_GLM:-200000}")
  workers=${WORKERS:-$([ "$fam" = kimi ] && echo 10 || echo 5)}  # Kimi's scenes are the slow ones to render
  local mix=$MIX; [ "$fam" = kimi ] && mix=$mix,image-qa=0.1,image-caption=0.08
  # Kimi at a third of GLM's rate: at 1.5e-3 it lost held-out chat (session 11), at 5e-4 it kept it (13)
  local lr=${LR:-$([ "$fam" = kimi ] && echo "${LR_KIMI:-5e-4}" || echo "${LR_GLM:-1.5e-3}")}
  $PY -m models.recipes.build --out "/tmp/r7-$fam" --family "$fam" --train-items "$items" --test-items 10 \
    --first-item "$FIRST_ITEM" --mixture "$mix" || return 4
  echo "data built at $(el) s"
  local bound=$(( MTP_END_S - $(el) ))
  [ "$bound" -gt 0 ] || { echo "no time left to train"; return 5; }
  timeout "$bound" $PY -m models.recipes.train --family "$fam" --data "/tmp/r7-$fam" --out "$W/$name" \
    --init "models/$name" --steps 0 --minutes "$TRAIN_MINUTES" --batch-tokens "${BATCH_TOKENS:-65536}" \
    --lr "$lr" --warmup "${WARMUP:-50}" --workers "$workers" $DEVICE_ARGS || return 5
  echo "trained at $(el) s"
  local left=$(( MTP_END_S - $(el) ))
  echo "MTP stage: $left s left before $MTP_END_S s"
  if [ "$left" -gt 90 ]; then
    local minutes; minutes=$(awk -v l="$left" -v m="$MTP_MINUTES" 'BEGIN { x = (l - 60) / 60; printf "%.2f", x < m ? x : m }')
    echo "MTP stage: $minutes minutes of training"
    if timeout "$left" $PY -m models.recipes.train_mtp --family "$fam" --data "/tmp/r7-$fam" --checkpoint "$W/$name" \
        --out "/tmp/r7-mtp-$fam" --init "models/$name" --minutes "$minutes" --max-items "${MTP_ITEMS:-60000}" \
        --batch-tokens "${MTP_BATCH_TOKENS:-65536}" --lr "${MTP_LR:-1e-3}" --warmup 20 --workers "$workers" \
        $DEVICE_ARGS > "$W/$fam-mtp.stdout" 2>&1; then
      $PY -c "import sys; from pathlib import Path; from models.recipes.train_mtp import install; install(Path(sys.argv[1]), Path(sys.argv[2]))" \
        "/tmp/r7-mtp-$fam" "$W/$name" || return 7
      local n=1; while [ -e "$W/$name/train_mtp.$n.log" ]; do n=$((n + 1)); done
      [ -e "$W/$name/train_mtp.log" ] && mv "$W/$name/train_mtp.log" "$W/$name/train_mtp.$n.log"
      cp "/tmp/r7-mtp-$fam/train.log" "$W/$name/train_mtp.log"
      echo "MTP installed at $(el) s"
    else
      echo "MTP stage failed or cut at $(el) s (the checkpoint has no MTP layer)"
    fi
  else
    echo "no time left for the MTP stage (the checkpoint has no MTP layer)"
  fi
  left=$(( EVAL_END_S - $(el) ))
  [ "$left" -gt 30 ] || { echo "no time left for the held-out eval"; return 8; }
  timeout "$left" $PY -m backend.tools.eval --heldout "$fam" --heldout-items "${HELDOUT_ITEMS:-300}" \
    --heldout-dir "/tmp/r7-heldout-$fam" --variant before="models/$name" --variant after="$W/$name" \
    --out "$W/heldout-$fam.json" $DEVICE_ARGS > "$W/$fam-heldout.stdout" 2>&1 \
    && echo "held-out eval done at $(el) s" || echo "held-out eval failed or cut at $(el) s"
}
pids=()
FAMILIES=${FAMILIES:-kimi glm}
for fam in $FAMILIES; do
  stage $fam > "$W/$fam.stdout" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
rm -rf "$W"/.*.staging
for name in kimi-k2.6-nano glm-5.2-nano; do
  [ -d "$W/$name" ] && tar -C "$W" -cf "$OUT/$name.tar" "$name" && echo "$name.tar at $(el) s"
done
tar -C "$W" -cf "$OUT/r7_train-logs.tar" --exclude='*-nano' . && echo "r7_train-logs.tar at $(el) s"
for fam in $FAMILIES; do
  echo "== $fam"; grep -vE "step [0-9]+ " "$W/$fam.stdout" | tail -10
  grep -E "step [0-9]+ " "$W/$fam.stdout" | awk 'NR%20==1' | tail -6
  echo "-- mtp"; tail -3 "$W/$fam-mtp.stdout" 2>/dev/null
  echo "-- held-out"; $PY -c "import json,sys; r=json.load(open(sys.argv[1]))
for t in r['tasks']: print(t['task'], [(v['variant'], round(v['accuracy'], 3), [round(x, 3) for x in v['delta_ci']]) for v in t['results']])" \
    "$W/heldout-$fam.json" 2>/dev/null || tail -3 "$W/$fam-heldout.stdout"
done
ls -la "$OUT"
exit $rc
