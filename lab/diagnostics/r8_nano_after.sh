#!/usr/bin/env bash
# Issue 26, the CPU continuation of a nano model (2026-12-05, no device lent), after
#   models.recipes.train --init models/<name> --data <recipe beb8792: copy drills + generator values>
# 1. its MTP layer continued from the committed one on the new trunk (MTP_MINUTES, CPU), installed;
# 2. the held-out everyday sets (seed 26, HELDOUT_ITEMS a set) committed vs new, paired, greedy through
#    serving's prompt path and parsers;
# 3. the classic test sets (first ITEMS items a task): the regression check;
# 4. teacher-forced copying on the seed-2604 held-out items (recipe26/tf_score.py): the figure to watch is
#    the share of string argument values copied (0 / 40 strings right before);
# 5. MTP acceptance with 3 drafts, committed vs new (benchmarks.engine.mtp_acceptance, MTP_PROMPTS a task).
#   bash lab/diagnostics/r8_nano_after.sh glm /tmp/r8/glm-5.2-nano /tmp/r8/data-glm
set -euo pipefail
FAM=${1:?glm or kimi}
NEW=${2:?the new checkpoint folder}
DATA=${3:?the training data folder (for the MTP stage)}
PY=${PYTHON:-/work/main/.venv/bin/python}
RES=${RES:-lab/results/2026-12-05-r8}
OLD=models/$([ "$FAM" = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
export PYTHONPATH=$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$RES"
if [ "${MTP_MINUTES:-10}" != 0 ]; then
  rm -rf "/tmp/r8-mtp-$FAM"
  $PY -m models.recipes.train_mtp --family "$FAM" --data "$DATA" --checkpoint "$NEW" --out "/tmp/r8-mtp-$FAM" \
    --init "$OLD" --minutes "${MTP_MINUTES:-10}" --max-items 20000 --batch-tokens 8192 --lr 1e-3 --warmup 20 \
    --device cpu > "$RES/$FAM-mtp.stdout" 2>&1
  $PY -c "import sys; from pathlib import Path; from models.recipes.train_mtp import install; install(Path(sys.argv[1]), Path(sys.argv[2]))" "/tmp/r8-mtp-$FAM" "$NEW"
  cp "/tmp/r8-mtp-$FAM/train.log" "$NEW/train_mtp.r8.log"
fi
$PY -m backend.tools.eval --heldout "$FAM" --heldout-items "${HELDOUT_ITEMS:-120}" --device cpu --batch-size 64 \
  --variant before="$OLD" --variant after="$NEW" --out "$RES/heldout-$FAM.json" > "$RES/heldout-$FAM.stdout" 2>&1
$PY -m models.recipes.build --out "/tmp/r8-classic-$FAM" --family "$FAM" --train-items 0 > /dev/null
data=()
for f in /tmp/r8-classic-"$FAM"/*.test.jsonl; do
  head -n "${ITEMS:-200}" "$f" > "/tmp/r8-classic-$FAM/$(basename "$f" .test.jsonl).jsonl"
  data+=(--data "/tmp/r8-classic-$FAM/$(basename "$f" .test.jsonl).jsonl")
done
$PY -m backend.tools.eval --device cpu --batch-size 64 --variant before="$OLD" --variant after="$NEW" "${data[@]}" \
  --out "$RES/classic-$FAM.json" > "$RES/classic-$FAM.stdout" 2>&1
$PY -c "import sys; from pathlib import Path; from backend.tools.eval_heldout import write_sets; write_sets(Path(sys.argv[1]), sys.argv[2], 200, seed=2604)" "/tmp/r8-sets2604-$FAM" "$FAM"
$PY lab/results/2026-12-04-r6/recipe26/tf_score.py --family "$FAM" --sets "/tmp/r8-sets2604-$FAM" \
  --variant before="$OLD" --variant after="$NEW" --out "$RES/tf-$FAM.json" > "$RES/tf-$FAM.stdout" 2>&1 || echo "tf_score failed: $RES/tf-$FAM.stdout"
for side in before after; do
  model=$([ $side = before ] && echo "$OLD" || echo "$NEW")
  $PY -m benchmarks.engine.mtp_acceptance --model "$model" --tasks chat,tool-call --prompts "${MTP_PROMPTS:-30}" \
    --speculative mtp:3 --out "$RES/mtp-acceptance-$FAM-$side.json" > "$RES/mtp-acceptance-$FAM-$side.stdout" 2>&1
done
echo "done: $RES"
